"""Delta checkpoints on real ps: only what changed is written, base + deltas restore the
state of the last delta exactly (variables, a sharded variable, a dynamic table with
evictions, optimizer slots) into another number of ps, and a ps that restarted gets a
full save instead of a delta that would miss its rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import load_file

import pstrain
from pstrain._checkpoint.deltas import ps_channels
from pstrain._formats.files import direct_writes, tensor_files
from pstrain._formats.files.direct_writes import DirectWriter
from pstrain._formats.messages.checkpoint_operations import HurryDeltas, SaveDelta
from pstrain._formats.numerics.idhash import shard_of
from pstrain._kernels import KERNELS
from pstrain.server.ps.checkpoints.saves import _save_thread
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, table_feed_example, wait_for

pytestmark = pytest.mark.timeout(90)

DIM = 4
table_feed = table_feed_example()


def _cluster(root: str, num_ps: int = 2) -> InProcessCluster:
    """Real in-process ps that may write under ``root``, and one worker."""
    return InProcessCluster(num_ps=num_ps, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root})


def _model(strategy: pstrain.ParameterServerStrategy, name: str = "opt", **more):
    """The model, its optimizer, and a checkpoint of them (and of ``more``)."""
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=40)
        big = pstrain.Variable(np.zeros((70_000, DIM), np.float32), name="big")  # row-tracked
        small = pstrain.Variable(np.zeros(3, np.float32), name="small")
        opt = pstrain.optimizers.Adagrad(0.1, name=name)
    ckpt = pstrain.Checkpoint(model={"emb": table, "big": big, "small": small}, optimizer=opt, **more)
    return table, big, small, opt, ckpt


async def _step(table, big, small, opt, k: int) -> None:
    """A deterministic update stream: step ``k`` touches its own ids and rows."""
    ids = np.arange(10 * k, 10 * k + 12, dtype=np.int64)  # past capacity 40: evictions
    await table.lookup(ids)
    grad = np.full((ids.size, DIM), 0.01 * (k + 1), np.float32)
    rows = np.array([k, 1000 + k, 69_999 - k])
    await opt.apply_gradients(
        [
            (pstrain.IndexedSlices(grad, ids), table),
            (pstrain.IndexedSlices(np.full((3, DIM), 0.5, np.float32), rows), big),
            (np.full(3, 0.25, np.float32), small),
        ]
    )


def _index(prefix: str) -> dict:
    with open(prefix + ".index.json", encoding="utf-8") as f:
        return json.load(f)


async def _state(table, big, small):
    ids, rows = await table.export()
    return ids, rows, (await big.read_value()).copy(), (await small.read_value()).copy()


async def test_base_plus_deltas_restore_the_last_delta_exactly_into_another_ps_count(tmp_path):
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, big, small, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
        await _step(table, big, small, opt, 0)
        base = await manager.save()
        paths = []
        for k in range(1, 6):
            await _step(table, big, small, opt, k)
            paths.append(await manager.save_delta())
        assert paths == [f"{base}.delta-{k}" for k in range(1, 6)]
        assert manager.latest_checkpoint == paths[-1] and manager.checkpoints == [base]
        expected = await _state(table, big, small)
        # Only what changed was written: 3 rows of the 70,000 of ``big`` (and of its slot).
        index = _index(paths[-1])
        big_parts = index["variables"]["model/big"]["parts"]
        assert sum(os.path.getsize(os.path.join(root, f)) for f in {p["file"] for p in big_parts}) < 64_000
        assert index["seq"] == _index(base)["seq"] + 5
        # Read without a cluster: the composed state.
        arrays = pstrain.checkpoint.load_variables(paths[-1])
        np.testing.assert_array_equal(arrays["model/big"], expected[2])
        np.testing.assert_array_equal(arrays["model/emb/ids"], expected[0])
        np.testing.assert_array_equal(arrays["model/emb/rows"], expected[1])
        assert await table.size() == 40 and arrays["model/emb/ids"].size == 40  # evictions applied

    for num_ps in (1, 2):  # (a capacity is per shard: 3 shards of 13 may not hold a 2-ps save)
        async with _cluster(root, num_ps) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            table, big, small, opt, ckpt = _model(strategy, name="opt2")
            manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
            assert await manager.restore_or_initialize() == paths[-1]
            got = await _state(table, big, small)
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)  # bit for bit
            held = [len(ps.tables["emb"]) for ps in cluster.ps]
            assert held == [int(np.sum(shard_of(expected[0], num_ps) == k)) for k in range(num_ps)]
            # The slots came back: one more step equals one more step on the original run.
            if num_ps == 2:  # evicting as the original run did
                await _step(table, big, small, opt, 6)
                after_restore = await _state(table, big, small)
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:  # no saves
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, big, small, opt, _ = _model(strategy)
        for k in range(7):
            await _step(table, big, small, opt, k)
        straight = await _state(table, big, small)
    for a, b in zip(after_restore, straight):
        np.testing.assert_allclose(a, b, rtol=1e-6)


async def test_a_restarted_ps_gets_a_full_save_not_a_delta_that_misses_its_rows(tmp_path):
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, big, small, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        await _step(table, big, small, opt, 0)
        base = await manager.save()
        cluster.ps[1].incarnation = "another"  # as after a restart: its marks mean nothing now
        cluster.ps[1].deltas.incarnation = "another"
        with pytest.raises(pstrain.errors.FailedPreconditionError, match="incarnation"):
            await ckpt.write_delta()
        assert not [f for f in os.listdir(root) if ".delta-" in f]  # nothing half-written left
        path = await manager.save_delta()
        assert path != base and ".delta-" not in path and manager.checkpoints == [base, path]


@contextlib.asynccontextmanager
async def _saved_then_stepped(root: str):
    """One ps: the model stepped once, saved (a manager's base), then steps 1 and 2."""
    async with _cluster(root, num_ps=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        model = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(model[-1], root)
        await _step(*model[:4], 0)
        await manager.save()
        for k in (1, 2):
            await _step(*model[:4], k)
        yield cluster, manager, model


async def test_a_large_variables_changed_rows_are_found_on_the_save_thread_not_the_loop(
    tmp_path, monkeypatch
):
    # The serving loop only ends the epoch: a pass over a big variable's row stamps (its
    # cost grows with the rows the ps holds) runs on the deltas' save thread.

    passes: list[str] = []
    rows_after = KERNELS.rows_after

    def spy(epochs, *args, **kwargs):
        if epochs.shape[0] == 70_000:  # big's stamps (the table's are a few dozen)
            passes.append(threading.current_thread().name)
        return rows_after(epochs, *args, **kwargs)

    async with _saved_then_stepped(str(tmp_path)) as (_, manager, (_, big, _, _, _)):
        monkeypatch.setattr(KERNELS, "rows_after", spy)
        path = await manager.save_delta()
        monkeypatch.undo()
        now = await big.read_value()
    assert passes and all(name.startswith("pstrain-save-delta") for name in passes), passes
    key = _index(path)["variables"]["model/big"]["parts"][0]["key"]
    idx = load_file(f"{path}.ps0.safetensors")[f"v:{key}:idx"]
    assert idx.tolist() == [1, 2, 1001, 1002, 69_997, 69_998]  # the rows steps 1 and 2 changed
    np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/big"], now)


async def test_a_delta_held_behind_its_writer_holds_the_table_as_of_its_mark(tmp_path):
    # A dynamic table's changed rows, ids and slots are gathered on the save thread too:
    # updates, evictions and new ids while the delta waits to be written keep their old
    # values first, so the delta is the table at its mark, not at its write.
    async with _saved_then_stepped(str(tmp_path)) as (cluster, manager, (table, big, small, opt, _)):
        at_mark = await _state(table, big, small)
        emb = cluster.ps[0].tables["emb"]
        gate = threading.Event()
        held = _save_thread("delta").submit(gate.wait, 60)  # the ps's deltas wait behind it
        try:
            writing = asyncio.ensure_future(manager.save_delta())
            await wait_for(lambda: bool(emb.saves), what="the delta's snapshot of the table")
            for k in (3, 4, 5):  # 36 new ids past capacity 40: evictions, rows reused
                await _step(table, big, small, opt, k)
        finally:
            gate.set()
        held.result(timeout=60)
        path = await writing
        after = await _state(table, big, small)
    assert not np.array_equal(np.sort(after[0]), np.sort(at_mark[0]))  # it changed meanwhile
    arrays = pstrain.checkpoint.load_variables(path)
    order, want = np.argsort(arrays["model/emb/ids"]), np.argsort(at_mark[0])
    np.testing.assert_array_equal(arrays["model/emb/ids"][order], at_mark[0][want])
    np.testing.assert_array_equal(arrays["model/emb/rows"][order], at_mark[1][want])
    np.testing.assert_array_equal(arrays["model/big"], at_mark[2])


async def test_bad_settings_are_refused_with_what_was_wrong(tmp_path):
    ckpt = pstrain.Checkpoint()
    # each refusal names the option, whatever the wrong value's type (an infinite interval
    # named delta_write_s, a string one raised TypeError, a fractional count passed)
    for option, bad in (
        ("delta_interval_s", 0),
        ("delta_interval_s", float("inf")),
        ("delta_interval_s", "5"),
        ("delta_interval_s", True),
        ("deltas_per_base", 0),
        ("deltas_per_base", 1.5),
        ("max_to_keep", 0),
        ("max_to_keep", 2.5),
        ("checkpoint_name", ""),
        ("checkpoint_name", 3),
    ):
        with pytest.raises(pstrain.errors.InvalidArgumentError, match=f"^{option} .*got {bad!r}$"):
            pstrain.checkpoint.CheckpointManager(ckpt, str(tmp_path), **{option: bad})
    assert not os.listdir(tmp_path)  # nothing written for any of them
    for bad in (-1.0, float("nan"), True, "1", 1e9):
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="delta_write_s"):
            pstrain.checkpoint.CheckpointManager(ckpt, str(tmp_path), delta_write_s=bad)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="at most half of delta_interval_s"):
        pstrain.checkpoint.CheckpointManager(ckpt, str(tmp_path), delta_interval_s=4, delta_write_s=2.5)
    # By default a delta is spread over a quarter of its interval; without one, not at all.
    made = pstrain.checkpoint.CheckpointManager
    assert made(ckpt, str(tmp_path), delta_interval_s=4).delta_write_s == 1.0
    assert made(ckpt, str(tmp_path), delta_interval_s=4, delta_write_s=2).delta_write_s == 2.0
    assert made(ckpt, str(tmp_path), delta_interval_s=4, delta_write_s=0).delta_write_s == 0.0
    assert made(ckpt, str(tmp_path)).delta_write_s == 0.0
    with pytest.raises(pstrain.errors.FailedPreconditionError, match="save first"):
        await ckpt.write_delta()


@contextlib.asynccontextmanager
async def _spread(root: str, monkeypatch, write_s: float, values: np.ndarray):
    """One ps whose ``big`` changed whole (to ``values``) after a base: a delta of 137
    buffers of 8 KiB, which the manager spreads over ``write_s``."""

    monkeypatch.setattr(direct_writes, "CHUNK", 8192)  # the in-process ps: a delta of many buffers
    async with _cluster(root, num_ps=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, big, small, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, delta_write_s=write_s)
        await manager.save()
        await big.assign(values)
        yield cluster, manager, table, ckpt


async def test_a_delta_spread_over_some_seconds_takes_them_on_the_ps_and_holds_the_same_rows(
    tmp_path, monkeypatch
):

    root = str(tmp_path)
    values = np.random.default_rng(0).random((70_000, DIM)).astype(np.float32)
    staged: list[int] = []  # what each paced writer takes in before any of it goes out
    init = DirectWriter.__init__

    def watched(self, fd, rate=None, **kwargs):
        init(self, fd, rate, **kwargs)
        if rate is not None:
            staged.append(self.capacity)

    monkeypatch.setattr(DirectWriter, "__init__", watched)
    async with _spread(root, monkeypatch, 0.5, values) as (_, manager, table, ckpt):
        t = asyncio.get_running_loop().time()
        path = await manager.save_delta()
        assert asyncio.get_running_loop().time() - t >= 0.45
        # The ps gathered the delta ahead of its writes (a quarter of the ~1.1 MB it holds,
        # as a power of two: 256 KiB), not one 8 KiB buffer at a time.
        assert staged == [256 << 10]
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/big"], values)
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="write_s"):
            await ckpt.write_delta(write_s=-1.0)
        # The ps itself refuses a spread it cannot take, naming it, and writes nothing.
        channel = next(iter(ps_channels({}, {"emb": table}).values()))
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="write_s"):
            await channel.request(
                SaveDelta(path=os.path.join(root, "x.safetensors"), since=0, incarnation="x", write_s=-1.0)
            )
        assert not os.path.exists(os.path.join(root, "x.safetensors"))


async def test_a_ps_that_stops_writes_the_rest_of_a_spread_delta_at_once(tmp_path, monkeypatch):
    """A delta spread over a minute does not keep a stopping ps's process waiting that long."""
    root = str(tmp_path)
    async with _spread(root, monkeypatch, 60, np.ones((70_000, DIM), np.float32)) as (cluster, manager, *_):
        writing = asyncio.ensure_future(manager.save_delta())
        await wait_for(lambda: any(f.endswith(".tmp") for f in os.listdir(root)), timeout=30)
        t = asyncio.get_running_loop().time()
        await cluster.ps[0].stop()
        # The delta's thread is free again (its file written) well before the minute is up.
        await asyncio.wrap_future(_save_thread("delta").submit(lambda: None))
        assert asyncio.get_running_loop().time() - t < 20
        writing.cancel()
        with contextlib.suppress(BaseException):
            await writing


async def test_closing_the_manager_has_a_spread_delta_under_way_written_at_once(tmp_path, monkeypatch):
    """close() waits for the delta being written, not for its minute-long spread: its ps is
    told to send the rest at once, and the delta holds the rows."""

    root = str(tmp_path)
    values = np.full((70_000, DIM), 3.0, np.float32)
    paced: list[float] = []  # the rate of each paced writer the ps makes
    init = DirectWriter.__init__

    def watched(self, fd, rate=None, **kwargs):
        init(self, fd, rate, **kwargs)
        if rate is not None:
            paced.append(rate)

    monkeypatch.setattr(DirectWriter, "__init__", watched)
    async with _spread(root, monkeypatch, 60, values) as (cluster, manager, table, ckpt):
        big = ckpt.model["big"]
        channel = next(iter(ps_channels({}, {"emb": table}).values()))
        assert (await channel.request(HurryDeltas())).hurried == 0  # none under way
        writing = asyncio.ensure_future(manager.save_delta())
        await wait_for(lambda: any(f.endswith(".tmp") for f in os.listdir(root)), timeout=30)
        t = asyncio.get_running_loop().time()
        await manager.close()
        path = await asyncio.wait_for(writing, 30)
        assert asyncio.get_running_loop().time() - t < 20
        assert ".delta-1" in path
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/big"], values)
        # The ps itself still spreads the next delta it is asked for.
        assert cluster.ps[0].checkpoints.stopped is False
        # A delta asked of the closed manager is not spread at all (no hurry can miss it).
        assert len(paced) == 1
        await big.assign(values + 1)
        t = asyncio.get_running_loop().time()
        path = await asyncio.wait_for(manager.save_delta(), 30)
        assert asyncio.get_running_loop().time() - t < 20 and len(paced) == 1
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/big"], values + 1)


async def test_a_save_threads_staging_buffer_is_given_back_once_it_writes_nothing_more(tmp_path, monkeypatch):
    """A spread delta's staging buffer stays for the next delta, then goes once the deltas'
    thread has written nothing for STAGING_IDLE_S; a delta after that still holds its rows."""

    monkeypatch.setattr(direct_writes, "STAGING_IDLE_S", 3.0)  # the check right after a delta sees it
    values = np.full((70_000, DIM), 5.0, np.float32)

    def delta_thread() -> int:  # asked on the deltas' save thread: the buffer is its own
        return _save_thread("delta").submit(direct_writes.staging_bytes).result(timeout=30)

    async with _spread(str(tmp_path), monkeypatch, 0.2, values) as (_, manager, _table, ckpt):
        await manager.save_delta()
        assert delta_thread() >= 256 << 10  # what the spread delta gathered ahead, kept
        await wait_for(lambda: delta_thread() == 0, timeout=30)
        await ckpt.model["big"].assign(values + 1)
        path = await manager.save_delta()
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/big"], values + 1)
        assert delta_thread() >= 256 << 10  # made again for it


async def test_a_staging_buffer_used_after_its_idle_check_was_set_goes_once_idle_after_all(
    tmp_path, monkeypatch
):
    """The check set when a delta ends finds the buffer taken again since (as a check that
    fires a little early finds it): it comes again once the buffer has been idle long enough,
    instead of leaving it held for good."""

    monkeypatch.setattr(direct_writes, "STAGING_IDLE_S", 1.0)
    values = np.full((70_000, DIM), 5.0, np.float32)
    thread = _save_thread("delta")
    async with _spread(str(tmp_path), monkeypatch, 0.2, values) as (_, manager, _table, _ckpt):
        await manager.save_delta()  # its check is set: it comes 1 s after the delta ended
        size = thread.submit(direct_writes.staging_bytes).result(timeout=30)
        assert size >= 256 << 10
        thread.submit(direct_writes._staging, size).result(timeout=30)  # taken again: not idle
        assert thread.submit(direct_writes.release_idle_staging).result(timeout=30) > 0  # kept
        await wait_for(
            lambda: thread.submit(direct_writes.staging_bytes).result(timeout=30) == 0,
            timeout=20,
            what="the staging buffer given back",
        )


async def test_deltas_written_on_their_own_lose_at_most_one_interval_of_steps(tmp_path):
    root = str(tmp_path)
    seen: dict[int, int] = {}  # delta number -> steps done before the step it was first seen after
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            done = pstrain.Variable(0, name="steps_done")
        table, big, small, opt, ckpt = _model(strategy, done=done)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, delta_interval_s=0.05, deltas_per_base=3)
        assert await manager.restore_or_initialize() is None
        steps = 0
        deadline = asyncio.get_running_loop().time() + 30
        while not any(k >= 201 for k in seen):  # a delta on the base a compaction wrote
            assert asyncio.get_running_loop().time() < deadline, f"deltas seen: {seen}"
            await _step(table, big, small, opt, steps % 9)
            await done.assign_add(1)
            steps += 1
            latest = manager.latest_checkpoint or ""
            key = (len(manager.checkpoints), int(latest.rsplit("-", 1)[1]) if ".delta-" in latest else 0)
            # (steps - 1: the step that was running when a delta began may or may not be in it)
            seen.setdefault(key[0] * 100 + key[1], steps - 1)
        last = max(k for k in seen if k % 100)
        before = max(v for k, v in seen.items() if k < last)  # steps done before it began
        assert len(manager.checkpoints) >= 2  # compacted into a new base while training ran
        await manager.close()  # (a delta under way is finished: it may be one more)
        latest = manager.latest_checkpoint
        # The job "dies" here: no final save.
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            done = pstrain.Variable(0, name="steps_done")
        table, big, small, opt, ckpt = _model(strategy, name="opt2", done=done)
        assert await pstrain.checkpoint.CheckpointManager(ckpt, root).restore_or_initialize() == latest
        restored = int(await done.read_value())
        assert before <= restored <= steps, (before, restored, steps, seen)


def test_a_delta_is_put_in_piece_by_piece_in_order(tmp_path, monkeypatch):
    """Patches are read and put in bounded pieces; later deltas win, and rows outside the
    part are skipped."""

    monkeypatch.setattr(tensor_files, "PATCH_ROWS", 3)
    base = np.arange(40, dtype=np.float32).reshape(20, 2)
    tensor_files.write_tensors(str(tmp_path / "base.safetensors"), {"w": base})
    first = np.array([0, 2, 3, 5, 7, 11, 13, 19], np.int64)
    second = np.array([3, 4, 19], np.int64)
    tensor_files.write_tensors(
        str(tmp_path / "d1.safetensors"), {"rows": np.full((first.size, 2), -1, np.float32), "idx": first}
    )
    tensor_files.write_tensors(
        str(tmp_path / "d2.safetensors"), {"rows": np.full((second.size, 2), -2, np.float32), "idx": second}
    )
    # rows 5..15 of the variable: a part, so delta rows outside it are skipped
    got = tensor_files.read_rows(
        (10, 2),
        np.dtype(np.float32),
        [[str(tmp_path / "base.safetensors"), "w", 5, 15, 0]],
        [[str(tmp_path / f), "rows", "idx", -5] for f in ("d1.safetensors", "d2.safetensors")],
    )
    want = base.copy()
    want[first] = -1
    want[second] = -2
    np.testing.assert_array_equal(got, want[5:15])


async def test_a_save_where_one_ps_never_stepped_its_share_of_a_table_restores_into_fewer_ps(tmp_path):
    """A save taken as training starts: one ps's share of the table has its optimizer slot,
    the other's not yet (no step reached it). Restored into one ps, the rows of the second
    get the slot's initial value (it was refused: "a slot is missing from some saved
    shard", which failed the replacement of a lost ps in a clean clone's run)."""
    root = str(tmp_path)
    ids = np.arange(40, dtype=np.int64)
    first = ids[shard_of(ids, 2) == 0]  # the ids of ps 0's share: the only ones stepped

    async def first_step(table, opt) -> None:  # every id admitted, ps 0's stepped
        await table.lookup(ids)
        await opt.apply_gradients(
            [(pstrain.IndexedSlices(np.ones((first.size, DIM), np.float32), first), table)]
        )

    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        await first_step(table, opt)
        assert [bool(ps.tables["emb"].slots) for ps in cluster.ps] == [True, False]
        path = await pstrain.checkpoint.CheckpointManager(
            pstrain.Checkpoint(emb=table, optimizer=opt), root
        ).save()
        before = await table.export()
    grad = np.full((ids.size, DIM), 0.5, np.float32)
    async with _cluster(root, num_ps=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        (await pstrain.Checkpoint(emb=table, optimizer=opt).restore(path)).assert_consumed()
        got = await table.export()
        order = np.argsort(got[0])
        np.testing.assert_array_equal(got[0][order], np.sort(before[0]))
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])  # every id
        after = await table.export()
    async with _cluster(root) as cluster:  # the same steps, no save
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        await first_step(table, opt)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
        straight = await table.export()
    a, s = np.argsort(after[0]), np.argsort(straight[0])
    np.testing.assert_array_equal(after[0][a], straight[0][s])
    np.testing.assert_array_equal(after[1][a], straight[1][s])  # the slots came back right


async def test_a_table_created_after_the_base_is_read_from_its_deltas(tmp_path):
    """A dynamic table made after the full save is in the deltas that follow (all of its
    rows, then what changed): ``load_variables`` gives it, a restore into another number of
    ps and onto tiered ps brings back every row and slot, and the feed serves it. (Its
    rows in the deltas were left out: ``load_variables`` had no such table, and a restore
    warned that the checkpoint had none and left it empty.)"""
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            old = pstrain.DynamicEmbedding(DIM, name="old")
            opt = pstrain.optimizers.Adagrad(0.1)
        ckpt = pstrain.Checkpoint(old=old, optimizer=opt)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        await old.lookup(np.arange(10, dtype=np.int64))
        await manager.save()
        with strategy.scope():
            new = pstrain.DynamicEmbedding(DIM, name="new", capacity=30)
        ckpt.new = new
        counts = []
        for k in range(3):  # its rows, stepped, some of them evicted past its capacity
            ids = np.arange(12 * k, 12 * k + 20, dtype=np.int64)
            rows = await new.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(np.cos(rows), ids), new)])
            delta = await manager.save_delta()
            entry = _index(delta)["tables"]["new"]
            counts.append((entry["rows"], entry["removed"], entry["whole"]))
        assert counts[0] == (20, 0, True) and all(not whole for *_, whole in counts[1:])
        assert all(rows == 20 for rows, *_ in counts) and sum(r for _, r, _ in counts) > 0  # (evicted)
        want_ids, want_rows = await new.export()
        assert set(_index(delta)["tables"]) == {"old", "new"}
        assert "new" not in _index(manager.checkpoints[0])["tables"]  # (the base has none)
        saved = pstrain.checkpoint.load_variables(delta)
        np.testing.assert_array_equal(saved["new/ids"], want_ids)
        np.testing.assert_array_equal(saved["new/rows"], want_rows)
        assert sorted(saved) == [
            "new/ids",
            "new/rows",
            "new/slot:optimizer/accumulator",
            "old/ids",
            "old/rows",
            "optimizer/iterations",
            "optimizer/iterations_mirror",
        ]
        await manager.close()

    grad = np.ones((want_ids.size, DIM), np.float32)
    after = []
    for num_ps, options in ((1, {}), (2, {"memory_budget": 1 << 20, "table_dir": str(tmp_path / "tier")})):
        async with InProcessCluster(
            num_ps=num_ps, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root, **options}
        ) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                old = pstrain.DynamicEmbedding(DIM, name="old")
                new = pstrain.DynamicEmbedding(DIM, name="new", capacity=30)
                opt = pstrain.optimizers.Adagrad(0.1)
            status = await pstrain.Checkpoint(old=old, new=new, optimizer=opt).restore(delta)
            status.assert_consumed()
            ids, rows = await new.export()
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(rows, want_rows)
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), new)])  # the slots came back
            after.append((await new.export())[1])
            if num_ps == 2:
                mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "new", TOKEN)
                async with aiohttp.ClientSession() as session:
                    assert await mirror.poll(session) > 0
                np.testing.assert_array_equal(mirror.snapshot()[0], want_ids)
                np.testing.assert_array_equal(mirror.snapshot()[1], want_rows)
    np.testing.assert_array_equal(after[0], after[1])


async def test_a_table_tracked_after_the_base_but_made_before_it_gets_a_full_save(tmp_path, caplog):
    """A table the base did not track, made (and stepped) before it: a delta would hold only
    its rows changed since, so the manager writes a full checkpoint instead, which holds all
    of them; so for a variable. A delta that does not say it holds such a table whole (as pstrain 0.2 wrote
    them) is not read for it: the table is left out, with a warning naming it."""
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            old = pstrain.DynamicEmbedding(DIM, name="old")
            late = pstrain.DynamicEmbedding(DIM, name="late")
        ckpt = pstrain.Checkpoint(old=old)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        await late.lookup(np.arange(30, dtype=np.int64))  # before the base, which leaves it out
        await manager.save()
        ckpt.late = late
        await late.lookup(np.arange(25, 35, dtype=np.int64))
        path = await manager.save_delta()
        assert ".delta-" not in path and "late" in _index(path)["tables"]  # a full save instead
        np.testing.assert_array_equal(
            pstrain.checkpoint.load_variables(path)["late/ids"], np.arange(35, dtype=np.int64)
        )
        with strategy.scope():  # the same for a variable, made before the last full save
            early = pstrain.Variable(np.zeros(8, np.float32), name="early")
        await early.assign(np.arange(8, dtype=np.float32))  # (made on its ps now)
        await manager.save()
        ckpt.early = early
        path = await manager.save_delta()
        assert ".delta-" not in path
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["early"], np.arange(8))
        with strategy.scope():  # made after the base: its deltas hold it whole
            new = pstrain.DynamicEmbedding(DIM, name="new")
            born = pstrain.Variable(np.ones(3, np.float32), name="born")
        ckpt.new, ckpt.born = new, born
        await new.lookup(np.arange(5, dtype=np.int64))
        delta = await manager.save_delta()
        assert ".delta-" in delta and _index(delta)["tables"]["new"]["whole"] is True
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(delta)["born"], np.ones(3))
        await manager.close()
    index = _index(delta)
    del index["tables"]["new"]["whole"], index["digest"]  # as pstrain 0.2 wrote it
    with open(delta + ".index.json", "w", encoding="utf-8") as f:
        json.dump(index, f)
    with caplog.at_level("WARNING", logger="pstrain"):
        saved = pstrain.checkpoint.load_variables(delta)
    assert "new/ids" not in saved and "late/ids" in saved
    assert "table 'new' is not in its base" in caplog.text
