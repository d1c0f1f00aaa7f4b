"""A ps in a cgroup with a memory limit (a container's, a SLURM job's): what it may hold by
default comes from that limit, not from the machine's RAM, so past it the ps refuses where
the kernel would kill it; sizes given past the limit are warned of. Real cgroups: the
test makes one of its own (root), and removes it."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import pstrain
from tests.helpers import MiB, strategy_for, wait_for, wait_until

pytestmark = pytest.mark.timeout(120)

LIMIT = 256 * MiB


def _memory_hierarchy() -> tuple[Path, str]:
    """Where a cgroup with a memory limit can be made, and the limit's file name: under this
    process's own cgroup in v1's memory hierarchy, or at the root of v2's (a cgroup v2 with
    processes cannot give its children controllers)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        point, (kind, _, options) = fields.split()[4], rest.split()[:3]
        if kind == "cgroup" and "memory" in options.split(","):
            memory = next(path for controllers, path in own.items() if "memory" in controllers.split(","))
            under = Path(point) / memory.lstrip("/")
            return (under if under.is_dir() else Path(point)), "memory.limit_in_bytes"
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        if rest.split()[0] == "cgroup2":
            root = Path(fields.split()[4])
            if "memory" in (root / "cgroup.controllers").read_text().split():
                return root, "memory.max"
    raise AssertionError("this machine has no memory cgroup controller")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup of its own, limited to ``LIMIT`` bytes, removed once empty."""
    parent, limit_file = _memory_hierarchy()
    group = parent / f"pstrain-test-{secrets.token_hex(4)}"
    group.mkdir()
    try:
        (group / limit_file).write_text(str(LIMIT))
        yield group
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().split(), 30, "the cgroup empty")
        group.rmdir()


def _in(group: Path) -> list[str]:
    """A command prefix that runs the rest of the command in cgroup ``group``."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)]


async def test_a_ps_in_a_cgroup_refuses_what_is_past_its_limit_instead_of_being_killed(
    memory_cgroup,
    drill,
    tmp_path,  # (the drill's processes stop before the cgroup goes)
):
    ps = await asyncio.to_thread(drill.serve, "--role", "ps", "--port", "0", wrapper=_in(memory_cgroup))
    strategy = strategy_for(ps)
    normal = pstrain.initializers.RandomNormal(seed=1)
    async with strategy.scope():  # 64 MiB, drawn on the ps: it holds them
        small = pstrain.Variable(normal, shape=(16 * MiB,), dtype=np.float32, name="small")
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="--max-store-bytes"):
        async with strategy.scope():  # 320 MiB: past the cgroup's 256, and 80 % of them
            pstrain.Variable(normal, shape=(80 * MiB,), dtype=np.float32, name="big")
    assert ps.proc.poll() is None, ps.stderr()  # refused, not killed
    read = await small.read_value()
    assert read.shape == (16 * MiB,) and 0.045 < float(np.std(read)) < 0.055
    await asyncio.to_thread(ps.stop)
    # Sizes given past the limit: said at the start, as the kernel would kill it there.
    budgeted = await asyncio.to_thread(
        drill.serve,
        "--role", "ps", "--port", "0", "--memory-budget", "1GiB", "--table-dir", str(tmp_path / "tier"),
        wrapper=_in(memory_cgroup),
    )  # fmt: skip
    await wait_for(
        lambda: "memory budget (--memory-budget)" in budgeted.stderr(), timeout=10, what="the warning"
    )
    assert f"more than this process may use ({LIMIT} bytes, its cgroup's memory limit)" in budgeted.stderr()
    await asyncio.to_thread(budgeted.stop)
