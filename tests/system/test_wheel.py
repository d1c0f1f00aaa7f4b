"""The built wheel, installed away from the source tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.timeout(180)
def test_demo_runs_from_the_built_wheel_away_from_the_source_tree(tmp_path):

    root = Path(__file__).resolve().parents[2]
    # Built in this environment (make installs pyproject.toml's build requirements here),
    # as `make install` builds: not in one pip would make for it (a third of the time).
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("pstrain-*.whl")
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
