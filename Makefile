# Every target sets itself up: a local virtual environment in .venv, reused
# when present, with the project installed in editable mode.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUFF := $(VENV)/bin/ruff check pstrain tests benchmarks examples fuzz
# The formatter owns the layout (line length 110, pyproject.toml): `ruff format` rewrites it.
FORMAT := $(VENV)/bin/ruff format --check pstrain tests benchmarks examples fuzz
# Python writes the bytecode of the modules it imports, in .venv and here: this machine's
# image sets PYTHONDONTWRITEBYTECODE=1, under which every process compiles every module it
# imports from source (pstrain's, about 0.2 s of each of the ~230 server processes of a
# test run; torch's, seconds). So pip installs without compiling: what runs is compiled
# once, by the first process that imports it, and the rest (sympy, scipy, pip, mypy's
# sources...) never.
unexport PYTHONDONTWRITEBYTECODE
# pstrain's bytecode, written on both cores before a target runs (what is current is skipped).
BYTECODE := $(PY) -m compileall -q -j 0 pstrain tests

.PHONY: install test check demo bench lint fuzz clean sysdeps compiler setup slurm screenshots chaos docs sequences

# The kernels (pstrain/_kernels/compiled.pyx and the parts it includes) are C, built by
# pip: a C compiler and Python's headers are installed with apt-get when missing.
compiler:
	command -v cc >/dev/null && $(PYTHON) -c "import os, sysconfig; \
		raise SystemExit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc \
		libc6-dev python3-dev >/dev/null)

# The kernels' build requirements (pyproject.toml's build-system) go into .venv first, and
# pip builds there, not in an environment it makes for each build (the wheel test builds
# again: the C generated here is reused).
BUILD_REQUIRES = $(PY) -c "import tomllib; \
	print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')"
$(STAMP): pyproject.toml setup.py pstrain/_kernels/compiled.pyx $(wildcard pstrain/_kernels/*.pxi) | compiler
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(BUILD_REQUIRES) > $(VENV)/build-requires.txt
	$(PY) -m pip install --quiet --no-compile -r $(VENV)/build-requires.txt
	# torch pinned to the CPU build (a range would fetch a CUDA build of several GB)
	$(PY) -m pip install --quiet --no-compile --no-build-isolation -e '.[dev]' 'torch==2.13.0'
	touch $(STAMP)

install: $(STAMP)

# The system packages (apt-get) and the Python ones (pip) install side by side: a fresh
# machine has neither, and each waits mostly on the network or one core.
setup:
	$(MAKE) --no-print-directory -j2 sysdeps $(STAMP)

# mypy (about 25 s from a fresh clone) checks while the tests run, its report printed after
# them; either failing fails the target. The tests wait on conditions, not on CPU time, and
# a quarter of the time a test waits on processes, sockets or timers: with two test
# processes (pytest-xdist, a test file to each at a time) the two cores were busy 1.5 of
# the time, with three they are busy (the tests took 305 s instead of 347 s). PYTEST_WORKERS=0
# runs them in one process.
PYTEST_WORKERS ?= 3
test: setup
	$(RUFF)
	$(FORMAT)
	$(BYTECODE)
	@$(VENV)/bin/mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS); \
	tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat .mypy.out; rm -f .mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0

# The inner loop: the unit and cluster tiers (tests/unit, tests/cluster and pstrain's
# doctests; no process, no system package) with ruff, in under two minutes. `make test`
# runs every tier (tests/README.md).
check: $(STAMP)
	$(RUFF)
	$(FORMAT)
	$(BYTECODE)
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile pstrain tests/unit \
		tests/cluster $(PYTEST_ARGS)

# What the multi-host tests need (tests/system/netlab.py: namespaces, nftables, tc; run as root),
# the SLURM test (tests/system/slurmlab.py: the distribution's slurm-wlm and munge), the browser
# tests of the dashboard (the distribution's chromium, driven by Playwright) and the
# Prometheus test (the distribution's prometheus).
sysdeps: compiler
	command -v nft >/dev/null && command -v tc >/dev/null && command -v sbatch >/dev/null \
		&& test -x /usr/sbin/munged && command -v chromium >/dev/null \
		&& command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq nftables iproute2 slurm-wlm munge chromium prometheus >/dev/null)

# Screenshots of the dashboard during `pstrain demo` (docs/dashboard*.png, for docs/operations.md).
screenshots: sysdeps $(STAMP)
	$(PY) benchmarks/dashboard_screenshots.py

# A real SLURM cluster on this machine (three nodes, each in its own network namespace;
# root) runs `sbatch examples/slurm/train.sbatch` and checks that the job ends COMPLETED.
slurm: sysdeps $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q -p no:cacheprovider tests/system/test_slurm.py

# The whole fault matrix (tests/system/test_fault_matrix.py): 7 faults alone and in every ordered
# pair, on 4 models, each run compared bit for bit with a run without faults (about 60 min;
# make test runs a sample of it).
chaos: sysdeps $(STAMP)
	$(BYTECODE)
	PSTRAIN_CHAOS=all $(PY) -m pytest -q -p no:cacheprovider tests/system/test_fault_matrix.py

# The random-sequence tests at length (make test runs a few seeds of each): overlapping joins,
# leaves, saves, deltas and a lost ps replaced; the serving feed followed through random
# chains; random chains restored onto other jobs (480 tests, about 75 s on 2 cores).
sequences: $(STAMP)
	$(BYTECODE)
	PSTRAIN_ELASTIC_SEEDS=100 PSTRAIN_FEED_SEEDS=100 PSTRAIN_CHECKPOINT_SEEDS=60 $(PY) -m pytest -q \
		-p no:cacheprovider -n 3 tests/cluster/test_elastic_tables.py tests/cluster/test_feed_sequences.py \
		tests/cluster/test_checkpoint_sequences.py -k 'random or sequence or chain'

# The documentation site (MkDocs, Material theme, API reference by mkdocstrings) into site/;
# strict: a broken link, anchor or reference fails the build. `make test` builds it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

demo: $(STAMP)
	$(BYTECODE)
	$(PY) -m pstrain.cli demo $(DEMO_ARGS)

# Every workload (W1-W7, benchmarks/run_all.py); BENCH=W4,W6 runs some of them, and
# TF_PYTHON=<a Python with tensorflow-cpu 2.21> adds W4 and W8 against TensorFlow in the same
# session, TORCHREC_PYTHON=<a Python with torchrec 1.9.2> W8 against TorchRec.
bench: $(STAMP)
	$(BYTECODE)
	$(PY) benchmarks/run_all.py $(if $(BENCH),--only '$(BENCH)') $(if $(TF_PYTHON),--tf-python '$(TF_PYTHON)') \
		$(if $(TORCHREC_PYTHON),--torchrec-python '$(TORCHREC_PYTHON)')

# The architecture's static checks (layers and cycles are checked by tests/unit/test_architecture.py).
lint: $(STAMP)
	$(RUFF)
	$(FORMAT)
	$(VENV)/bin/mypy

# Coverage-guided fuzzing of the wire decoder (atheris), FUZZ_SECONDS long (default 300).
FUZZ_SECONDS ?= 300
fuzz: $(STAMP)
	$(PY) -m pip install --quiet -e '.[fuzz]'
	mkdir -p .fuzz-corpus
	$(PY) fuzz/fuzz_wire.py -max_total_time=$(FUZZ_SECONDS) .fuzz-corpus

clean:
	rm -rf $(VENV) build *.egg-info benchmarks/results/*.tmp
