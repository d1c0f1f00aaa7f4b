"""``pstrain serve --memory-budget --table-dir``: a ps that keeps its tables' rows past its
budget on disk, in a directory of its own that it removes when it stops, or that the next
ps started on the same directory removes after a SIGKILL; and flags given wrong."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain._kernels import compiled
from tests.helpers import TOKEN, strategy_for, wait_for

pytestmark = pytest.mark.timeout(120)


async def test_a_tiered_ps_process_trains_past_its_budget_and_cleans_its_directory(drill, tmp_path):
    tier = tmp_path / "tier"
    ps = drill.serve(
        "--role", "ps", "--index", "0", "--port", "0", "--memory-budget", "2MiB", "--table-dir", str(tier)
    )
    (own,) = os.listdir(tier)  # its own directory, named for its process
    assert own.startswith(f"pstrain-{ps.proc.pid}-")
    strategy = strategy_for(ps)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="emb")
    for k in range(8):
        await table.lookup(np.arange(1000 * k, 1000 * k + 1000))
    stats = await table.statistics()
    assert stats["rows"] == 8000 and stats["cold_rows"] > 2000, stats
    rows = await table.lookup(np.arange(0, 1000), training=False)  # read from disk, left there
    after = await table.statistics()
    assert rows.shape == (1000, 16) and after["read_through"] >= 1000
    assert after["promoted"] == stats["promoted"]
    await table.lookup(np.arange(0, 1000))  # a training lookup brings them back into RAM
    assert (await table.statistics())["promoted"] >= stats["promoted"] + 1000
    # pstrain status: a line for the tiered table, its rows in RAM and on disk
    worker = drill.serve("--role", "worker", "--index", "0", "--port", "0")
    spec = {"cluster": {"ps": [ps.address], "worker": [worker.address]}}
    (tmp_path / "cluster.json").write_text(json.dumps(spec))
    status = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pstrain", "status", "--cluster", str(tmp_path / "cluster.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PSTRAIN_TOKEN": TOKEN},
    )
    assert status.returncode == 0, status.stdout + status.stderr
    stats = await table.statistics()
    line = next(ln for ln in status.stdout.splitlines() if "emb:" in ln)
    assert f"{stats['hot_rows']} rows in RAM, {stats['cold_rows']} on disk" in line, status.stdout
    assert "hit rate" in line and "reads from disk/s" in line and "0 refused" in line
    assert stats["cold_reads"] > 0, stats  # its rows read back from disk: it says how
    assert (", io_uring)" if _rings_read_here(tmp_path) else ", pread)") in line, status.stdout
    # SIGKILL: its directory stays; the next ps on the same --table-dir removes it
    ps.proc.send_signal(signal.SIGKILL)
    ps.proc.wait(30)
    assert os.listdir(tier) == [own]
    again = drill.serve(
        "--role", "ps", "--index", "0", "--port", "0", "--memory-budget", "2MiB", "--table-dir", str(tier)
    )
    (now,) = os.listdir(tier)
    assert now != own and now.startswith(f"pstrain-{again.proc.pid}-")
    # a ps that stops removes its own
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(30) == 0
    await wait_for(lambda: not os.listdir(tier), timeout=10, what="the directory removed")


#: A ps as a container runs it: the first process (pid 1) of a PID namespace of its own; a
#: SIGTERM to ``unshare`` reaches it.
NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child=SIGTERM"]


async def test_ps_in_pid_namespaces_of_their_own_keep_a_live_ps_rows_and_remove_a_killed_ones(
    drill, tmp_path
):
    # ps in containers share a --table-dir (a node's disk). A ps starting there keeps the
    # directory of a ps that lives, whose pid is no process in its namespace, and removes
    # that of a ps killed, whose pid (1) is its own: a directory's lock says, not its pid.
    tier = tmp_path / "tier"
    flags = (*"--role ps --index 0 --port 0 --memory-budget 2MiB --table-dir".split(), str(tier))
    host = await asyncio.to_thread(drill.serve, *flags)
    (host_dir,) = os.listdir(tier)
    strategy = strategy_for(host)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="emb")
    for k in range(8):
        await table.lookup(np.arange(1000 * k, 1000 * k + 1000))
    ids, rows = await table.export()
    assert (await table.statistics())["cold_rows"] > 2000
    contained = await asyncio.to_thread(drill.serve, *flags, wrapper=NEW_PID_NAMESPACE)
    (its_dir,) = set(os.listdir(tier)) - {host_dir}
    assert its_dir.startswith("pstrain-1-") and host_dir in os.listdir(tier)
    await table.lookup(np.arange(0, 1000))  # rows back from disk, others out to it: it trains on
    np.testing.assert_array_equal((await table.export())[1], rows)
    proc = contained.proc.pid  # (unshare's: the ps is its child)
    (pid,) = Path(f"/proc/{proc}/task/{proc}/children").read_text().split()
    os.kill(int(pid), signal.SIGKILL)
    await asyncio.to_thread(contained.proc.wait, 30)
    assert sorted(os.listdir(tier)) == sorted([host_dir, its_dir])  # left by the ps killed
    again = await asyncio.to_thread(drill.serve, *flags, wrapper=NEW_PID_NAMESPACE)
    (new_dir,) = set(os.listdir(tier)) - {host_dir}
    assert new_dir != its_dir and new_dir.startswith("pstrain-1-")
    got_ids, got_rows = await table.export()
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_rows, rows)
    await asyncio.to_thread(again.stop)
    await wait_for(lambda: os.listdir(tier) == [host_dir], timeout=20, what="its directory removed")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--memory-budget", "1GiB"], "--memory-budget needs --table-dir"),
        (["--table-dir", "/tmp"], "--table-dir needs --memory-budget"),
        (["--memory-budget", "lots", "--table-dir", "/tmp"], "--memory-budget: it must be a size in bytes"),
    ],
)
def test_tiering_flags_given_wrong_are_one_line_naming_them(flags, says):
    env = {**os.environ, "PSTRAIN_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, "-m", "pstrain.cli", "serve", "--role", "ps", "--index", "0", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode != 0
    assert says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


async def test_a_local_cluster_tiers_its_ps_as_asked(drill, tmp_path):
    cluster = await drill.cluster(1, 1, memory_budget="2MiB", table_dir=tmp_path / "tier")
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="emb")
    for k in range(8):
        await table.lookup(np.arange(1000 * k, 1000 * k + 1000))
    assert (await table.statistics())["cold_rows"] > 2000
    (own,) = os.listdir(tmp_path / "tier")
    assert own.startswith(f"pstrain-{cluster.pid('ps', 0)}-")


def test_a_local_cluster_needs_both_a_budget_and_a_directory(tmp_path):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="memory_budget needs table_dir"):
        pstrain.LocalCluster(memory_budget="1GiB")
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="memory_budget must be a size"):
        pstrain.LocalCluster(memory_budget="much", table_dir=tmp_path)


def _status_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


async def test_a_tiered_ps_filled_by_requests_large_for_its_budget_stays_within_it_and_15_percent(
    drill, tmp_path
):
    """32 MiB and requests of 16,384 unseen ids (each a lookup, then an Adagrad update):
    the arrays a request makes and frees are a large share of so small a budget, and
    malloc keeps only a share of the budget of what they free, so the ps's peak RSS (the
    kernel's high-water mark, from after its first request) stays within the budget
    + 15 % while its table fills the budget and goes on to disk."""
    budget = 32 << 20
    cluster = await drill.cluster(1, 1, memory_budget=budget, table_dir=tmp_path / "tier")
    pid = cluster.pid("ps", 0)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="emb")
        optimizer = pstrain.optimizers.Adagrad(0.05)

    async def step(ids: np.ndarray) -> None:
        rows = await table.lookup(ids)
        await optimizer.apply_gradients([(pstrain.IndexedSlices(np.full_like(rows, 0.01), ids), table)])

    await step(np.arange(1000) + (1 << 40))  # its code paths run once: the baseline
    start = _status_bytes(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the RSS now
    rng = np.random.default_rng(0)
    for _ in range(36):
        await step(rng.integers(0, 1 << 62, 16384))
    peak = _status_bytes(pid, "VmHWM") - start
    stats = await table.statistics()
    assert stats["cold_rows"] > 4 * stats["hot_rows"] > 0, stats
    assert peak <= 1.15 * budget, f"peak RSS {peak / budget:.3f}x the budget"


def _rings_read_here(tmp_path) -> bool:
    """Whether a read of records through the compiled kernels goes through io_uring in this
    environment (this kernel, its seccomp profile, ``PSTRAIN_IO_URING``), as in the ps."""
    path = tmp_path / "probe.rec"
    path.write_bytes(bytes(64))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert compiled.pread_records(fd, np.zeros(1, np.int64), 64, np.zeros((1, 64), np.uint8)) == 0
    finally:
        os.close(fd)
    return compiled.io_uring_reads() is True
