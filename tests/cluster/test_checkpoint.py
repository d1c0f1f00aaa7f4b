"""Checkpoints on real ps (in process; a process where one is killed): every tracked kind,
resharding, delayed restore, crash safety, evaluator."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

import pstrain
from pstrain._checkpoint.evaluator import restored_iterations
from pstrain._formats.files.checkpoint_files import INDEX
from pstrain._formats.files.tensor_files import write_tensors
from pstrain._formats.messages.operations import ReadVariables
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(90)


class Model(pstrain.Module):
    def __init__(self, table_init=None):
        super().__init__()
        self.table = pstrain.Variable(
            table_init if table_init is not None else np.zeros((12, 3), np.float32), name="table"
        )
        self.w = pstrain.Variable(np.zeros((4, 2)), name="w")
        self.bias = pstrain.Variable(np.float32(0.0), name="bias")


def fresh_ps(n, root):
    """``n`` new ps, in this process (``async with fresh_ps(4, tmp_path) as cluster: cluster.ps``)."""
    return InProcessCluster(num_ps=n, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(root)})


@pytest_asyncio.fixture
async def four_ps(tmp_path):
    async with fresh_ps(4, tmp_path) as cluster:
        yield cluster.ps


async def test_round_trip_of_every_tracked_kind(ps_pair, tmp_path):
    rng = np.random.default_rng(0)
    strategy = strategy_for(*ps_pair, shards=2)
    async with strategy.scope():
        model = Model(rng.standard_normal((12, 3)).astype(np.float32))
        opt = pstrain.optimizers.Adam(0.1)
        mean = pstrain.metrics.Mean()
        step = pstrain.Variable(np.int64(7), name="step")
    extra = {"counters": [step]}
    await opt.apply_gradients(
        [(pstrain.IndexedSlices(np.ones((2, 3)), [1, 10]), model.table), (np.ones((4, 2)), model.w)]
    )
    await mean.update_state([1.0, 3.0])
    ckpt = Checkpoint(model=model, optimizer=opt, metric=mean, extra=extra)
    path = await ckpt.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1")  # TF's save_counter numbering
    saved = load_variables(path)
    assert set(saved) == {
        "model/table",
        "model/w",
        "model/bias",
        "extra/counters/0",
        "optimizer/iterations",
        "optimizer/iterations_mirror",  # the step counter again, on another ps
        "metric/total",
        "metric/count",
        *(f"model/{v}/.OPTIMIZER_SLOT/optimizer/{s}" for v in ("table", "w") for s in ("m", "v")),
    }
    assert saved["model/table"].shape == (12, 3)  # one logical variable
    before = {k: v.copy() for k, v in saved.items()}
    # change everything, then restore
    await opt.apply_gradients([(np.ones((12, 3)), model.table), (np.ones((4, 2)), model.w)])
    await mean.update_state([100.0])
    await step.assign(99)
    (await ckpt.restore(path)).assert_consumed()
    assert (await model.table.numpy()).tobytes() == before["model/table"].tobytes()
    assert (await model.w.numpy()).tobytes() == before["model/w"].tobytes()
    assert await opt.iterations.numpy() == 1 and await step.numpy() == 7
    assert await mean.result() == 2.0
    ch = pstrain.rpc.Channel(ps_pair[0].address, token=TOKEN, task="ps0")
    m_name = f"{opt.name}/m/table/part_0"  # "Adam" unless another Adam was made first
    m_part = (await ch.request(ReadVariables(names=[m_name]))).values[0]
    assert m_part.tobytes() == before["model/table/.OPTIMIZER_SLOT/optimizer/m"][:6].tobytes()
    await ch.close()


@pytest.mark.parametrize("saved_parts, restored_parts", [(4, 1), (1, 4), (4, 2), (2, 4)])
async def test_resharding(four_ps, tmp_path, saved_parts, restored_parts):
    table = np.arange(30, dtype=np.float32).reshape(10, 3)
    a = strategy_for(*four_ps, shards=saved_parts if saved_parts > 1 else None)
    async with a.scope():
        t = pstrain.Variable(table, name="emb")
    path = await Checkpoint(t=t).write(str(tmp_path / "ckpt-1"))
    async with fresh_ps(4, tmp_path) as fresh:
        b = strategy_for(*fresh.ps, shards=restored_parts if restored_parts > 1 else None)
        async with b.scope():
            t2 = pstrain.Variable(np.zeros((10, 3), np.float32), name="emb")
        assert len(getattr(t2, "variables", [t2])) == restored_parts
        await Checkpoint(t=t2).restore(path)
        np.testing.assert_array_equal(await t2.numpy(), table)


@pytest.mark.parametrize("restored_parts", [2, 4])
async def test_deferred_restore_by_path(four_ps, tmp_path, restored_parts):
    """Variables attached after restore() at saved paths take the saved values (TF's
    deferred restoration), into another number of parts, whatever their names."""
    a = strategy_for(*four_ps, shards=4)
    async with a.scope():
        t = pstrain.Variable(np.arange(20, dtype=np.float32).reshape(10, 2), name="emb")
        s = pstrain.Variable(3.0, name="scalar")
    model = pstrain.Module()
    model.t, model.s = t, s
    path = await Checkpoint(model=model).write(str(tmp_path / "ckpt-1"))
    async with fresh_ps(4, tmp_path) as fresh:
        b = strategy_for(*fresh.ps, shards=restored_parts)
        restored = pstrain.Module()
        ckpt = Checkpoint(model=restored)
        status = await ckpt.restore(path)  # nothing exists yet
        with pytest.raises(AssertionError, match="model/s"):
            status.assert_consumed()
        with b.scope():
            restored.t = pstrain.Variable(np.zeros((10, 2), np.float32), name="other_name")
            restored.s = pstrain.Variable(0.0, name="also_different")
        np.testing.assert_array_equal(await restored.t.numpy(), np.arange(20).reshape(10, 2))
        assert await restored.s.numpy() == 3.0
        status.assert_consumed()
        late = Checkpoint()
        status = await late.restore(path)
        with b.scope():
            late.model = pstrain.Module()
            late.model.s = pstrain.Variable(0.0)  # attached to an object attached later
        assert await late.model.s.numpy() == 3.0


class Dense(pstrain.Module):
    def __init__(self, rows, cols, seed):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.kernel = pstrain.Variable(rng.standard_normal((rows, cols)).astype(np.float32))
        self.bias = pstrain.Variable(np.zeros(cols, np.float32))


class Tower(pstrain.Module):
    def __init__(self, seed):
        super().__init__()
        self.embedding = pstrain.Variable(
            np.random.default_rng(seed).standard_normal((16, 4)).astype(np.float32)
        )
        self.dense = Dense(4, 2, seed + 1)


async def _train(model, opt, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        await opt.apply_gradients(
            [
                (pstrain.IndexedSlices(rng.standard_normal((3, 4)), rng.integers(0, 16, 3)), model.embedding),
                (rng.standard_normal((4, 2)), model.dense.kernel),
                (rng.standard_normal(2), model.dense.bias),
            ]
        )


async def test_restore_is_keyed_by_path_not_by_name(four_ps, tmp_path):
    """The issue's acceptance test: names shift (an extra variable first, a second
    optimizer in the process), yet every variable, slot and iterations come back bit for bit."""
    strategy = strategy_for(*four_ps, shards=2)
    async with strategy.scope():
        model = Tower(0)
        opt = pstrain.optimizers.Adagrad(0.1)
    await _train(model, opt, 3, seed=1)
    path = await Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    saved = load_variables(path)
    assert "model/embedding/.OPTIMIZER_SLOT/optimizer/accumulator" in saved
    assert "model/dense/kernel/.OPTIMIZER_SLOT/optimizer/accumulator" in saved

    async with strategy.scope():
        pstrain.Variable(np.zeros((4, 2), np.float32))  # shifts every generated name
        model2 = Tower(100)
        opt2 = pstrain.optimizers.Adagrad(0.1)
    assert opt2.name != opt.name and model2.dense.kernel.name != model.dense.kernel.name
    status = await Checkpoint(model=model2, optimizer=opt2).restore(path)
    status.assert_existing_objects_matched().assert_nontrivial_match()
    for key, var in (
        ("model/embedding", model2.embedding),
        ("model/dense/kernel", model2.dense.kernel),
        ("model/dense/bias", model2.dense.bias),
        ("optimizer/iterations", opt2.iterations),
    ):
        assert (await var.numpy()).tobytes() == saved[key].tobytes(), key
    # slots: created lazily by the first apply_gradients, yet they carry the saved values.
    await _train(model, opt, 1, seed=7)
    await _train(model2, opt2, 1, seed=7)
    status.assert_consumed()
    for a, b in (
        (model.embedding, model2.embedding),
        (model.dense.kernel, model2.dense.kernel),
        (model.dense.bias, model2.dense.bias),
        (opt.iterations, opt2.iterations),
    ):
        assert (await a.numpy()).tobytes() == (await b.numpy()).tobytes()
    after = load_variables(await Checkpoint(model=model2, optimizer=opt2).write(str(tmp_path / "b")))
    before = load_variables(await Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "a")))
    assert set(after) == set(before)
    for key in before:
        assert after[key].tobytes() == before[key].tobytes(), key

    # a tracked object the checkpoint has no value for is reported by the assertions
    async with strategy.scope():
        model3 = Tower(5)
        model3.extra = pstrain.Variable(1.0)
    status = await Checkpoint(model=model3, optimizer=pstrain.optimizers.Adagrad(0.1)).restore(path)
    with pytest.raises(AssertionError, match="model/extra"):
        status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="model/extra"):
        status.assert_consumed()
    # a value that matched nothing: a deliberately missing attribute
    async with strategy.scope():
        model4 = Tower(5)
    del model4.dense
    status = await Checkpoint(model=model4, optimizer=pstrain.optimizers.Adagrad(0.1)).restore(path)
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="model/dense/kernel"):
        status.assert_consumed()
    status.expect_partial()


async def test_restore_status_edges(ps_server, tmp_path, caplog):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        w = pstrain.Variable(np.ones(3, np.float32))
    path = await Checkpoint(w=w).write(str(tmp_path / "c"))
    status = await Checkpoint(w=w).restore(None)  # TF: an initialization-only status
    with pytest.raises(AssertionError, match="No checkpoint specified"):
        status.assert_consumed()
    status = await Checkpoint(other=w).restore(path)
    with pytest.raises(AssertionError, match="nothing in checkpoint"):
        status.assert_nontrivial_match()
    with caplog.at_level("WARNING", logger="pstrain.checkpoint"):
        del status
        import gc

        gc.collect()
    assert "never restored" in caplog.text and "'w'" not in caplog.text and " w" in caplog.text
    # shape mismatch at the same path: a clear error, nothing changed
    async with strategy.scope():
        w2 = pstrain.Variable(np.zeros(4, np.float32))
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="'w' was saved as"):
        await Checkpoint(w=w2).restore(path)
    assert (await w2.numpy()).tolist() == [0, 0, 0, 0]


def test_format_1_checkpoints_are_refused_by_restore_and_read_by_load_variables(tmp_path):

    write_tensors(str(tmp_path / "old.local.safetensors"), {"w": np.arange(3, dtype=np.float32)})
    (tmp_path / "old.index.json").write_text(
        json.dumps(
            {
                "format": "pstrain-checkpoint",
                "version": 1,
                "variables": {
                    "w": {
                        "dtype": "<f4",
                        "shape": [3],
                        "parts": [{"file": "old.local.safetensors", "key": "w", "offset": 0, "rows": 3}],
                    }
                },
            }
        )
    )
    assert load_variables(str(tmp_path / "old"))["w"].tolist() == [0, 1, 2]
    w = pstrain.Variable(np.zeros(3, np.float32))
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="keyed variables by name"):
        asyncio.run(Checkpoint(w=w).restore(str(tmp_path / "old")))


async def test_manager_keeps_the_last_n_and_restores_the_latest(ps_server, tmp_path):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
    manager = CheckpointManager(Checkpoint(v=v), str(tmp_path), max_to_keep=2)
    assert manager.latest_checkpoint is None and await manager.restore_or_initialize() is None
    for i in range(1, 5):
        await v.assign(float(i))
        await manager.save()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
    assert not any(name.startswith(("ckpt-1.", "ckpt-2.")) for name in os.listdir(tmp_path))
    await v.assign(-1.0)
    assert await manager.restore_or_initialize() == str(tmp_path / "ckpt-4")
    assert await v.numpy() == 4.0
    assert await manager.save(checkpoint_number=10) == str(tmp_path / "ckpt-10")
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-10")


TF_MANAGER = json.loads(
    (Path(__file__).resolve().parents[1] / "unit" / "references" / "tf_manager.json").read_text()
)


@pytest.mark.parametrize(
    "case", TF_MANAGER["cases"], ids=lambda c: f"keep{c['max_to_keep']}-every{c['hours']}h"
)
async def test_manager_preserves_a_save_every_n_hours_as_tfs_does(ps_server, tmp_path, case):
    """``keep_checkpoint_every_n_hours``: after each save of a timeline, the saves on disk
    and those ``checkpoints`` lists are TensorFlow's (``references/make_references.py
    tf_manager``: TF's manager with its clock set to each save's time; here each save's
    time is its index file's, set to the same timeline). A new manager, whatever its
    settings, never deletes a preserved save."""
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
    start = time.time()
    manager = CheckpointManager(
        Checkpoint(v=v),
        str(tmp_path),
        max_to_keep=case["max_to_keep"],
        keep_checkpoint_every_n_hours=case["hours"],
    )

    def numbers(paths):
        return sorted(int(os.path.basename(p).rsplit("-", 1)[1]) for p in paths)

    for t, on_disk, listed in zip(case["times"], case["on_disk"], case["listed"]):
        path = await manager.save()
        os.utime(path + INDEX, (start + t * 3600, start + t * 3600))
        assert numbers(p[: -len(INDEX)] for p in glob.glob(str(tmp_path / f"ckpt-*{INDEX}"))) == on_disk
        assert numbers(manager.checkpoints) == listed
    preserved = sorted(set(case["on_disk"][-1]) - set(case["listed"][-1]))
    again = CheckpointManager(Checkpoint(v=v), str(tmp_path), max_to_keep=1)
    await again.save()
    kept = numbers(p[: -len(INDEX)] for p in glob.glob(str(tmp_path / f"ckpt-*{INDEX}")))
    assert kept == [*preserved, len(case["times"]) + 1] and numbers(again.checkpoints) == [
        len(case["times"]) + 1
    ]


async def test_a_managers_unreadable_record_of_preserved_saves_is_an_error(ps_server, tmp_path):
    async with strategy_for(ps_server).scope():
        v = pstrain.Variable(0.0, name="v")
    (tmp_path / "ckpt.preserved.json").write_text("{not json")
    with pytest.raises(pstrain.errors.DataLossError, match="ckpt.preserved.json .* cannot be read"):
        CheckpointManager(Checkpoint(v=v), str(tmp_path))
    for bad in (0, -1.0, "1", float("nan")):
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="keep_checkpoint_every_n_hours"):
            CheckpointManager(Checkpoint(v=v), str(tmp_path / "other"), keep_checkpoint_every_n_hours=bad)


async def test_manager_saves_at_tfs_step_interval_numbers_by_a_variable_and_initializes(ps_server, tmp_path):
    """TF's ``step_counter`` and ``checkpoint_interval``: a save too soon is skipped (None),
    ``check_interval=False`` saves whenever the step moved; a variable numbers a save; with
    no save ``restore_or_initialize`` calls ``init_fn``, awaited."""
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
        step = pstrain.Variable(np.int64(0), name="step", trainable=False)
    inits = []

    async def init_fn():
        inits.append(1)
        await v.assign(7.0)

    manager = CheckpointManager(
        Checkpoint(v=v, step=step), str(tmp_path), step_counter=step, checkpoint_interval=10, init_fn=init_fn
    )
    assert manager.checkpoint_interval == 10
    assert await manager.restore_or_initialize() is None and inits == [1] and await v.numpy() == 7.0
    saved = []
    for s in (0, 3, 9, 10, 12, 20, 20):
        await step.assign(np.int64(s))
        saved.append(await manager.save(checkpoint_number=step))
    names = [os.path.basename(p) if p else None for p in saved]
    assert names == ["ckpt-0", None, None, "ckpt-10", None, "ckpt-20", None]
    await step.assign(np.int64(21))
    assert await manager.save(check_interval=False) is not None  # the step moved: saved
    assert await manager.save(check_interval=False) is None  # it did not
    again = CheckpointManager(
        Checkpoint(v=v, step=step), str(tmp_path), step_counter=step, checkpoint_interval=10
    )
    await step.assign(np.int64(0))
    assert await again.restore_or_initialize() == manager.latest_checkpoint
    assert int(await step.numpy()) == 21 and await again.save() is None  # the restored step counts
    for bad, message in (
        (dict(checkpoint_interval=5), "`step_counter` should be passed"),
        (dict(step_counter=step, checkpoint_interval=0), "checkpoint_interval"),
        (dict(step_counter=3), "step_counter must be a pstrain.Variable"),
        (dict(init_fn=5), "init_fn must be callable"),
    ):
        with pytest.raises(pstrain.errors.InvalidArgumentError, match=message):
            CheckpointManager(Checkpoint(v=v), str(tmp_path), **bad)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="checkpoint_number"):
        await CheckpointManager(Checkpoint(v=v), str(tmp_path / "other")).save(checkpoint_number=-1)


async def test_tfs_latest_checkpoint_list_variables_and_load_variable(ps_server, tmp_path):
    """``tf.train.latest_checkpoint``, ``list_variables`` and ``load_variable``: the newest
    save in a directory (a delta's, the name saved last), and a checkpoint's names, shapes
    and values, a directory standing for its newest."""
    from pstrain.checkpoint import latest_checkpoint, list_variables, load_variable

    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="v")
        table = pstrain.DynamicEmbedding(2, name="emb")
    await table.lookup(np.array([5, 9, 11]))
    assert latest_checkpoint(str(tmp_path)) is None and latest_checkpoint(str(tmp_path / "none")) is None
    ckpt = Checkpoint(v=v, table=table)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    for _ in range(2):
        await manager.save()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-2")
    await v.assign(np.full((3, 2), 7.0, np.float32))
    delta = await manager.save_delta()
    assert latest_checkpoint(str(tmp_path)) == delta == str(tmp_path / "ckpt-2.delta-1")
    other = await Checkpoint(v=v).save(str(tmp_path / "other"), options=object())  # another name, saved last
    # (TF's CheckpointOptions are taken, to no effect, by save, write, restore and read)
    assert latest_checkpoint(str(tmp_path)) == other
    names = list_variables(delta)
    assert ("v", [3, 2]) in names and ("table/ids", [3]) in names and ("table/rows", [3, 2]) in names
    assert names == sorted(names)
    assert load_variable(delta, "v").tolist() == [[7.0, 7.0]] * 3  # the delta's value
    assert load_variable(str(tmp_path / "ckpt-1"), "v").tolist() == [[0, 1], [2, 3], [4, 5]]
    assert load_variable(delta, "table/ids").tolist() == [5, 9, 11]
    assert load_variable(str(tmp_path), "v").tolist() == [[7.0, 7.0]] * 3  # the directory's newest
    with pytest.raises(pstrain.errors.NotFoundError, match="has no value 'w'"):
        load_variable(delta, "w")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(pstrain.errors.NotFoundError, match="no checkpoint in directory"):
        list_variables(str(empty))


async def test_a_file_where_the_checkpoints_directory_should_be_is_a_clear_error(ps_server, tmp_path):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match=f"CheckpointManager: {blocker} is a file, not a directory"
    ):
        CheckpointManager(Checkpoint(v=v), str(blocker))
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match="its directory cannot be made"
    ):  # was a FileExistsError
        await Checkpoint(v=v).write(str(blocker / "ckpt"))
    assert blocker.read_text() == "not a directory"
    assert await Checkpoint(v=v).write(str(tmp_path / "ok" / "ckpt")) == str(tmp_path / "ok" / "ckpt")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(pstrain.errors.NotFoundError, match="no checkpoint"):
        load_variables(str(tmp_path / "nope"))


async def test_sidecar_evaluator_follows_a_running_job(ps_server, tmp_path):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        w = pstrain.Variable(np.zeros(3), name="w")
        opt = pstrain.optimizers.SGD(1.0)
    manager = CheckpointManager(Checkpoint(w=w, optimizer=opt), str(tmp_path), max_to_keep=3)
    seen = []

    def evaluate(variables, iterations):
        seen.append(iterations)
        return {"w_sum": float(variables["w"].sum())}

    evaluator = pstrain.evaluator.SidecarEvaluator(
        evaluate, str(tmp_path), max_evaluations=3, poll_interval_s=0.05
    )
    task = asyncio.ensure_future(evaluator.run())

    async def job():  # a running job: keeps training and saving until the evaluator is done
        for _ in range(300):
            if task.done():
                return
            await opt.apply_gradients([(-np.ones(3), w)])
            await manager.save()
            await asyncio.sleep(0.05)  # the job's pace, not synchronisation

    await job()
    results = await asyncio.wait_for(task, 30)
    assert len(results) == 3
    assert seen == sorted(seen) and len(set(seen)) == 3  # always a newer checkpoint
    for _, iterations, metrics in results:
        assert metrics["w_sum"] == 3.0 * iterations


def test_evaluator_needs_iterations(tmp_path):

    with pytest.raises(RuntimeError, match="`iterations` cannot be loaded"):
        restored_iterations({"w": np.zeros(2)})


async def test_a_save_without_a_step_mirror_restores_the_mirror_from_the_step(tmp_path):
    """A job on one ps keeps no mirror of its step counter; restored into two ps, the
    mirror takes the step (a later loss of the counter's ps then keeps the count)."""
    root = str(tmp_path)
    async with InProcessCluster(num_ps=1, num_workers=1, ps_options={"checkpoint_root": root}) as c:
        strategy = pstrain.ParameterServerStrategy(c.resolver)
        with strategy.scope():
            w = pstrain.Variable(np.zeros(3, np.float32), name="w")
            opt = pstrain.optimizers.SGD(0.1)
        for _ in range(5):
            await opt.apply_gradients([(np.ones(3, np.float32), w)])
        assert opt.iterations_mirror is None
        path = await pstrain.Checkpoint(w=w, opt=opt).save(f"{root}/ckpt")
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as c:
        strategy = pstrain.ParameterServerStrategy(c.resolver)
        with strategy.scope():
            w = pstrain.Variable(np.zeros(3, np.float32), name="w")
            opt = pstrain.optimizers.SGD(0.1)
        assert opt.iterations_mirror is not None
        status = await pstrain.Checkpoint(w=w, opt=opt).restore(path)
        status.assert_consumed()  # the missing mirror is no unmatched object
        assert int(await opt.iterations.read_value()) == 5
        assert int(await opt.iterations_mirror.read_value()) == 5
        await opt.apply_gradients([(np.ones(3, np.float32), w)])
        assert int(await opt.iterations_mirror.read_value()) == 6
