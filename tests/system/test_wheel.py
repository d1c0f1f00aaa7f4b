"""The built wheel, installed away from the source tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import pstrain

pytestmark = pytest.mark.timeout(120)


def _run(args: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The release as a user gets it: the sdist, and the wheel built from that sdist (in this
    environment, which has pyproject.toml's build requirements, as `make install` builds:
    one compile of the kernels, not one in an isolated environment pip would make)."""
    root = Path(__file__).resolve().parents[2]
    dist = tmp_path_factory.mktemp("dist")
    sdist = _run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)],
        120,
        cwd=root,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    (archive,) = dist.glob("pstrain-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "pstrain/_kernels/compiled.pyx",
        *(f"pstrain/_kernels/{p.name}" for p in (root / "pstrain" / "_kernels").glob("*.pxi")),
        "pstrain/py.typed",
    ):
        assert needed in names, f"the sdist lacks {needed}"
    build = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(archive),
        ],
        240,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("pstrain-*.whl")
    return archive, wheel


@pytest.mark.timeout(300)
def test_the_wheel_installs_in_a_clean_virtual_environment(tmp_path, release):
    """A fresh venv, the wheel and its dependencies from the package index: the command says
    its version, and the README's first program runs there."""
    _, wheel = release
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], 60)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG", "PYTHONPATH"))}
    install = _run([str(python), "-m", "pip", "install", "-q", "--no-compile", str(wheel)], 240, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    version = _run([str(venv / "bin" / "pstrain"), "--version"], 60, env=env, cwd=tmp_path)
    assert version.stdout.strip() == f"pstrain {pstrain.__version__}", version.stdout + version.stderr
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    program = readme.split("## A first program", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "first.py").write_text(program)
    first = _run([str(python), "-P", "first.py"], 120, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]


@pytest.mark.timeout(180)
def test_demo_runs_from_the_built_wheel_away_from_the_source_tree(tmp_path, release):
    _, wheel = release
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "pstrain" / "ctr.py").exists()  # the demo's model ships in the package
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    env["PYTHONPATH"] = str(site)
    where = subprocess.run(
        [sys.executable, "-P", "-c", "import pstrain; print(pstrain.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=30,
    )
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    demo = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "pstrain.cli",
            "demo",
            "--steps",
            "40",
            "--quiet",
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=150,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["steps"] == 40
