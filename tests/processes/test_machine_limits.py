"""What a task may use of its machine, in a container, a SLURM job or a systemd unit: a ps
in a cgroup with a memory limit holds by default what that limit allows, not the machine's
RAM, so past it the ps refuses where the kernel would kill it (sizes given past the limit
are warned of); a task's thread pools are sized for the cores it may use (its cpuset, its
CPU quota), not the machine's. Real cgroups and cpusets: the tests make their own (root),
and remove them."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import pstrain
from tests.helpers import MiB, rss, strategy_for, wait_for, wait_until

pytestmark = pytest.mark.timeout(120)

LIMIT = 256 * MiB


def _hierarchy(controller: str) -> tuple[Path, bool]:
    """Where a cgroup limited by ``controller`` can be made, and whether cgroup v2: under this
    process's own cgroup in v1's hierarchy of it, or at the root of v2's (a cgroup v2 with
    processes cannot give its children controllers)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        point, (kind, _, options) = fields.split()[4], rest.split()[:3]
        if kind == "cgroup" and controller in options.split(","):
            path = next(p for controllers, p in own.items() if controller in controllers.split(","))
            under = Path(point) / path.lstrip("/")
            return (under if under.is_dir() else Path(point)), False
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        if rest.split()[0] == "cgroup2":
            root = Path(fields.split()[4])
            if controller in (root / "cgroup.subtree_control").read_text().split():
                return root, True
    raise AssertionError(f"this machine gives no cgroup the {controller} controller")


@contextmanager
def _cgroup(controller: str, v1: dict[str, str], v2: dict[str, str]) -> Iterator[Path]:
    """A cgroup of its own with the files ``v1`` or ``v2`` (by the hierarchy's version)
    written, removed once its processes are gone."""
    parent, is_v2 = _hierarchy(controller)
    group = parent / f"pstrain-test-{secrets.token_hex(4)}"
    group.mkdir()
    try:
        for name, value in (v2 if is_v2 else v1).items():
            (group / name).write_text(value)
        yield group
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().split(), 30, "the cgroup empty")
        group.rmdir()


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup limited to ``LIMIT`` bytes of memory."""
    with _cgroup("memory", {"memory.limit_in_bytes": str(LIMIT)}, {"memory.max": str(LIMIT)}) as group:
        yield group


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
    with pytest.raises(pstrain.errors.ResourceExhaustedError, match="--max-store-bytes"):
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


async def test_a_ps_in_a_cgroup_refuses_to_grow_its_tables_past_its_limit_instead_of_being_killed(
    memory_cgroup,
    drill,  # (the drill's processes stop before the cgroup goes)
):
    # Dynamic tables in RAM (no --memory-budget) grow as ids arrive: two of them, each within
    # --max-variable-bytes, together past the cgroup's 256 MiB. The ps refuses the lookup
    # that would grow them past what it may hold, and serves on.
    ps = await asyncio.to_thread(drill.serve, "--role", "ps", "--port", "0", wrapper=_in(memory_cgroup))
    strategy = strategy_for(ps)
    with strategy.scope():
        tables = [pstrain.DynamicEmbedding(64, name=f"t{k}") for k in range(2)]
        opt = pstrain.optimizers.Adagrad(0.1)
    grown = 0
    with pytest.raises(pstrain.errors.ResourceExhaustedError, match="--max-store-bytes") as refused:
        while True:
            ids = np.arange(grown, grown + 25_000)
            for table in tables:
                rows = await table.lookup(ids)
                await opt.apply_gradients([(pstrain.IndexedSlices(np.ones_like(rows), ids), table)])
            grown += ids.size
            assert grown < 4_000_000, "never refused"
    assert "grow" in str(refused.value) and ps.proc.poll() is None, ps.stderr()  # not killed
    assert rss(ps.proc.pid) < LIMIT
    before = await tables[0].lookup(np.arange(100), training=False)  # it serves on
    np.testing.assert_array_equal(await tables[0].lookup(np.arange(100), training=False), before)
    assert (await tables[0].statistics())["rows"] >= grown


async def test_a_ps_in_a_cgroup_refuses_a_restore_past_its_limit_before_reading_it(
    memory_cgroup,
    drill,  # (the drill's processes stop before the cgroup goes)
    tmp_path,
):
    # A table saved from a ps with room for it (300,000 rows of 64 floats with Adagrad:
    # 154 MB), restored onto a ps in a cgroup of 256 MiB: read whole and composed, it took
    # twice that, and the kernel killed the ps. The ps refuses it before it reads its rows,
    # and serves on.
    root = str(tmp_path)
    roomy = await asyncio.to_thread(drill.serve, "--role", "ps", "--port", "0", "--checkpoint-root", root)
    with strategy_for(roomy).scope():
        table = pstrain.DynamicEmbedding(64, name="t")
        opt = pstrain.optimizers.Adagrad(0.1)
    for lo in range(0, 300_000, 50_000):
        ids = np.arange(lo, lo + 50_000)
        rows = await table.lookup(ids)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones_like(rows), ids), table)])
    path = await pstrain.Checkpoint(model={"t": table}, optimizer=opt).save(os.path.join(root, "c"))
    await asyncio.to_thread(roomy.stop)
    ps = await asyncio.to_thread(
        drill.serve, "--role", "ps", "--port", "0", "--checkpoint-root", root, wrapper=_in(memory_cgroup)
    )
    with strategy_for(ps).scope():
        table = pstrain.DynamicEmbedding(64, name="t")
        opt = pstrain.optimizers.Adagrad(0.1)
    kept = await table.lookup(np.arange(10), training=True)
    with pytest.raises(pstrain.errors.ResourceExhaustedError, match="300000 rows.*--max-store-bytes"):
        await pstrain.Checkpoint(model={"t": table}, optimizer=opt).restore(path)
    assert ps.proc.poll() is None, ps.stderr()  # refused, not killed
    assert rss(ps.proc.pid) < LIMIT // 2
    np.testing.assert_array_equal(await table.lookup(np.arange(10), training=False), kept)


#: What a worker alone on its host (its ps on others) sets its thread pools to, printed.
SIZED = """
import os, sys
from pstrain.cli.threads import presize_serve
env = {}
presize_serve(["serve", "--role", "worker", "--index", "0", "--cluster", sys.argv[1]], env)
print(env["OMP_NUM_THREADS"], env["OPENBLAS_NUM_THREADS"], len(os.sched_getaffinity(0)))
"""


def _sized(tmp_path: Path, prefix: list[str]) -> tuple[str, str, str]:
    # (no address here is dialled: the cluster file only says which tasks share the host)
    config = {"cluster": {"ps": ["192.0.2.1:2222"], "worker": ["127.0.0.1:2222"]}}
    (tmp_path / "cluster.json").write_text(json.dumps(config))
    done = subprocess.run(
        [*prefix, sys.executable, "-c", SIZED, str(tmp_path / "cluster.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    omp, openblas, cores = done.stdout.split()
    return omp, openblas, cores


def test_a_task_in_a_cpuset_or_under_a_cpu_quota_sizes_its_threads_for_the_cores_it_may_use(tmp_path):
    # SLURM's allocation, docker --cpuset-cpus: the cores it may run on. A pod's CPU limit,
    # docker --cpus: a quota of CPU time. Pools for every core of the machine oversubscribe.
    assert _sized(tmp_path, ["taskset", "-c", "0"]) == ("1", "1", "1")
    one_core = {"cpu.cfs_quota_us": "100000", "cpu.cfs_period_us": "100000"}
    with _cgroup("cpu", one_core, {"cpu.max": "100000 100000"}) as group:
        assert _sized(tmp_path, _in(group)) == ("1", "1", str(len(os.sched_getaffinity(0))))
    everything = str(len(os.sched_getaffinity(0)))
    assert _sized(tmp_path, []) == (everything, everything, everything)
