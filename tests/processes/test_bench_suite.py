"""`make bench` (benchmarks/run_all.py) runs every workload of WORKLOADS.md, and says what
it leaves out and why. Only its plan is run here (``--list``): the workloads themselves
measure the machine, and live in benchmarks/, never in timed tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "benchmarks" / "run_all.py"
WORKLOADS = ROOT.parent / "shared" / "WORKLOADS.md"


def plan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN_ALL), "--list", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.timeout(90)
def test_make_bench_runs_every_workload_of_workloads_md_or_says_why_not():
    spec = set(re.findall(r"^## (W\d+)\b", WORKLOADS.read_text(), re.M))
    assert spec >= {f"W{i}" for i in range(1, 8)}
    out = plan(env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    planned = [line.split() for line in out.stdout.splitlines() if not line.startswith("not run:")]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("not run:")]
    for _, script, *_ in planned:
        assert (ROOT / "benchmarks" / script).is_file(), script
    covered = {p[0] for p in planned} | {w for w in spec if any(f"{w} (" in s for s in skipped)}
    assert spec <= covered, (spec - covered, out.stdout)
    # W6's headline ratio is a ratio of medians over several rotated rounds in one run
    (w6,) = [p for p in planned if p[0] == "W6"]
    assert w6[1:] == ["dynamic_tables.py", "--runs", "5"]
    # without a TensorFlow to run, the comparison with it is named as not run, with the way on
    assert any("against TensorFlow" in s and "TF_PYTHON" in s for s in skipped), out.stdout


@pytest.mark.timeout(90)
def test_w8_runs_against_each_peer_given_and_names_each_one_missing():
    alone = plan("--only", "W8", env={"PATH": "/usr/bin:/bin"})
    assert alone.returncode == 0, alone.stderr
    lines = alone.stdout.splitlines()
    assert ["W8", "recsys.py"] in [line.split() for line in lines]
    assert any("W8 against TensorFlow" in x and "TF_PYTHON" in x for x in lines), lines
    assert any("W8 against TorchRec" in x and "TORCHREC_PYTHON" in x for x in lines), lines
    both = plan("--only", "W8", "--tf-python", "/tf/python", "--torchrec-python", "/tr/python")
    (w8,) = [x.split() for x in both.stdout.splitlines() if "recsys.py" in x]
    assert w8[2:] == ["--tf-python", "/tf/python", "--torchrec-python", "/tr/python"]
    assert "not run" not in both.stdout


@pytest.mark.timeout(90)
def test_make_bench_refuses_a_selection_it_cannot_run_naming_it():
    unknown = plan("--only", "W4,W10")
    assert unknown.returncode == 2 and "W10" in unknown.stderr and "W1" in unknown.stderr
    tf = plan("--only", "tf", env={"PATH": "/usr/bin:/bin"})
    assert tf.returncode == 2 and "--tf-python" in tf.stderr
    some = plan("--only", "W4,W6")
    assert some.returncode == 0, some.stderr
    assert [line.split()[0] for line in some.stdout.splitlines()] == ["W4", "W6"]
    with_tf = plan("--only", "W4,tf", "--tf-python", sys.executable)
    assert with_tf.stdout.splitlines()[-1].split()[:3] == ["tf", "against_tf.py", "--tf-python"]


@pytest.mark.timeout(90)
def test_the_tensorflow_comparison_says_what_is_missing_before_it_measures_anything(tmp_path):
    script = ROOT / "benchmarks" / "against_tf.py"
    missing = subprocess.run(
        [sys.executable, str(script), "--tf-python", str(tmp_path / "python")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "cannot be run" in missing.stderr
    assert "tensorflow-cpu==2.21.0" in missing.stderr  # how to make one
    bare = tmp_path / "bare-python"  # an interpreter without TensorFlow, as Python says it
    bare.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'tensorflow'\" >&2\nexit 1\n")
    bare.chmod(0o755)
    without = subprocess.run(
        [sys.executable, str(script), "--tf-python", str(bare)], capture_output=True, text=True, timeout=120
    )
    assert without.returncode == 1 and "has no TensorFlow" in without.stderr, without.stderr


@pytest.mark.timeout(120)
def test_w8_says_which_peer_is_missing_before_it_measures_anything(tmp_path):
    bare = tmp_path / "bare-python"  # an interpreter without TorchRec, as Python says it
    bare.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torchrec'\" >&2\nexit 1\n")
    bare.chmod(0o755)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "recsys.py"), "--torchrec-python", str(bare)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 1 and "has no TorchRec" in out.stderr, out.stderr
    assert "../shared/anchors/README.md" in out.stderr
