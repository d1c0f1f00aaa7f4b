"""The SLURM path for real: slurm-wlm's daemons, one node per network namespace, a real
``sbatch`` of ``examples/slurm/train.sbatch`` (see tests/system/slurmlab.py)."""

import json
import os
import re
import sys

import pytest

from .slurmlab import SlurmLab

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "slurm")


@pytest.mark.timeout(180)
def test_the_slurm_example_trains_and_its_job_ends_completed_on_nodes_that_sort_badly_as_strings():
    # n8, n9, n10: "n10" < "n8" as strings; ranks follow SLURM's (natural) node order.
    with SlurmLab(["n8", "n9", "n10"]) as lab:
        out = os.path.join(lab.dir, "job.out")
        bin_dir = os.path.dirname(sys.executable)
        env = lab.env(PATH=f"{bin_dir}:{os.environ['PATH']}", PSTRAIN_TOKEN=os.urandom(16).hex())
        job = lab.sbatch(
            "--chdir",
            os.path.abspath(EXAMPLE),
            "--output",
            out,
            os.path.abspath(os.path.join(EXAMPLE, "train.sbatch")),
            env=env,
        )
        state, code = lab.wait_job(job, timeout=120, output=out)
        with open(out, encoding="utf-8") as f:
            log = f.read()
        assert (state, code) == ("COMPLETED", "0:0"), log[-4000:]
        assert "w = [100. 100. 100." in log, log[-4000:]
        spec = json.loads(re.search(r"^cluster: (.*)$", log, re.M).group(1))
        assert spec == {
            "chief": ["n8:8888"],
            "ps": ["n8:8889", "n8:8890"],
            "worker": ["n9:8888", "n9:8889", "n10:8888", "n10:8889"],
        }
        assert log.count("the coordinator's job is done; leaving") == 6  # every server left
