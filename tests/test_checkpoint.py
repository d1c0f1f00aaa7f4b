"""Checkpoints on real ps (in process; a process where one is killed): every tracked kind,
resharding, delayed restore, crash safety, evaluator."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import pytest_asyncio

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.partitioners import FixedShardsPartitioner
from pstrain.testing import InProcessCluster

from .conftest import TOKEN

pytestmark = pytest.mark.timeout(90)


def make_strategy(ps, shards=None):
    spec = {"ps": [s.address for s in ps], "worker": ["127.0.0.1:9"]}
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN),
        variable_partitioner=FixedShardsPartitioner(shards) if shards else None)


class Model(pstrain.Module):
    def __init__(self, table_init=None):
        super().__init__()
        self.table = pstrain.Variable(table_init if table_init is not None else np.zeros((12, 3), np.float32),
                                      name="table")
        self.w = pstrain.Variable(np.zeros((4, 2)), name="w")
        self.bias = pstrain.Variable(np.float32(0.0), name="bias")


def fresh_ps(n, root):
    """``n`` new ps, in this process (``async with fresh_ps(4, tmp_path) as cluster: cluster.ps``)."""
    return InProcessCluster(num_ps=n, num_workers=1, token=TOKEN,
                            ps_options={"checkpoint_root": str(root)})


@pytest_asyncio.fixture
async def four_ps(tmp_path):
    async with fresh_ps(4, tmp_path) as cluster:
        yield cluster.ps


async def test_round_trip_of_every_tracked_kind(ps_pair, tmp_path):
    rng = np.random.default_rng(0)
    strategy = make_strategy(ps_pair, shards=2)
    async with strategy.scope():
        model = Model(rng.standard_normal((12, 3)).astype(np.float32))
        opt = pstrain.optimizers.Adam(0.1)
        mean = pstrain.metrics.Mean()
        step = pstrain.Variable(np.int64(7), name="step")
    extra = {"counters": [step]}
    await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((2, 3)), [1, 10]), model.table),
                               (np.ones((4, 2)), model.w)])
    await mean.update_state([1.0, 3.0])
    ckpt = Checkpoint(model=model, optimizer=opt, metric=mean, extra=extra)
    path = await ckpt.save(str(tmp_path / "ckpt-1"))
    saved = load_variables(path)
    assert {"table", "w", "bias", "step", "Adam/iterations", "Adam/m/table", "Adam/v/w",
            "mean/total", "mean/count"} <= set(saved)
    assert saved["table"].shape == (12, 3)  # one logical variable
    before = {k: v.copy() for k, v in saved.items()}
    # change everything, then restore
    await opt.apply_gradients([(np.ones((12, 3)), model.table), (np.ones((4, 2)), model.w)])
    await mean.update_state([100.0])
    await step.assign(99)
    await ckpt.restore(path)
    assert (await model.table.numpy()).tobytes() == before["table"].tobytes()
    assert (await model.w.numpy()).tobytes() == before["w"].tobytes()
    assert await opt.iterations.numpy() == 1 and await step.numpy() == 7
    assert await mean.result() == 2.0
    ch = pstrain.rpc.Channel(ps_pair[0].address, token=TOKEN, task="ps0")
    m_part = (await ch.call("vars/read", {"names": ["Adam/m/table/part_0"]}))["values"][0]
    assert m_part.tobytes() == before["Adam/m/table"][:6].tobytes()
    await ch.close()


@pytest.mark.parametrize("saved_parts, restored_parts", [(4, 1), (1, 4), (4, 2), (2, 4)])
async def test_resharding(four_ps, tmp_path, saved_parts, restored_parts):
    table = np.arange(30, dtype=np.float32).reshape(10, 3)
    a = make_strategy(four_ps, shards=saved_parts if saved_parts > 1 else None)
    async with a.scope():
        t = pstrain.Variable(table, name="emb")
    path = await Checkpoint(t=t).save(str(tmp_path / "ckpt-1"))
    async with fresh_ps(4, tmp_path) as fresh:
        b = make_strategy(fresh.ps, shards=restored_parts if restored_parts > 1 else None)
        async with b.scope():
            t2 = pstrain.Variable(np.zeros((10, 3), np.float32), name="emb")
        assert len(getattr(t2, "variables", [t2])) == restored_parts
        await Checkpoint(t=t2).restore(path)
        np.testing.assert_array_equal(await t2.numpy(), table)


@pytest.mark.parametrize("restored_parts", [2, 4])
async def test_delayed_restore(four_ps, tmp_path, restored_parts):
    a = make_strategy(four_ps, shards=4)
    async with a.scope():
        t = pstrain.Variable(np.arange(20, dtype=np.float32).reshape(10, 2), name="emb")
        s = pstrain.Variable(3.0, name="scalar")
    path = await Checkpoint(t=t, s=s).save(str(tmp_path / "ckpt-1"))
    async with fresh_ps(4, tmp_path) as fresh:
        b = make_strategy(fresh.ps, shards=restored_parts)
        holder = {}
        with b.scope():
            await Checkpoint(model=holder).restore(path)  # nothing exists yet
            holder["t"] = pstrain.Variable(np.zeros((10, 2), np.float32), name="emb")
            holder["s"] = pstrain.Variable(0.0, name="scalar")
        np.testing.assert_array_equal(await holder["t"].numpy(), np.arange(20).reshape(10, 2))
        assert await holder["s"].numpy() == 3.0


async def test_manager_keeps_the_last_n_and_restores_the_latest(ps_server, tmp_path):
    strategy = make_strategy([ps_server])
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


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(pstrain.errors.NotFoundError, match="no checkpoint"):
        load_variables(str(tmp_path / "nope"))


async def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(ps_process, tmp_path):
    ps_server = ps_process  # a process: this test blocks its loop reading the saver's output
    script = tmp_path / "saver.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np, pstrain
        from pstrain.checkpoint import Checkpoint, CheckpointManager
        async def main():
            spec = {{"ps": ["{ps_server.address}"], "worker": ["127.0.0.1:9"]}}
            s = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token="{TOKEN}"))
            async with s.scope():
                big = pstrain.Variable(pstrain.initializers.Ones(), shape=(4_000_000, 8), name="big")
            manager = CheckpointManager(Checkpoint(big=big), "{tmp_path / 'run'}", max_to_keep=None)
            await manager.save()
            print("saved", flush=True)
            while True:
                await big.assign_add(np.ones((4_000_000, 8), np.float32))
                await manager.save()
        pstrain.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        run_dir = tmp_path / "run"
        deadline = asyncio.get_running_loop().time() + 60
        while not any(".tmp" in n for n in os.listdir(run_dir)):  # a later save is being written
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    manager = CheckpointManager(None, str(run_dir), max_to_keep=None)
    assert manager.checkpoints  # every visible checkpoint is complete and loads
    for path in manager.checkpoints:
        arrays = load_variables(path)
        assert arrays["big"].shape == (4_000_000, 8) and arrays["big"][0, 0] == arrays["big"][-1, -1]


async def test_sidecar_evaluator_follows_a_running_job(ps_server, tmp_path):
    strategy = make_strategy([ps_server])
    async with strategy.scope():
        w = pstrain.Variable(np.zeros(3), name="w")
        opt = pstrain.optimizers.SGD(1.0)
    manager = CheckpointManager(Checkpoint(w=w, optimizer=opt), str(tmp_path), max_to_keep=3)
    seen = []

    def evaluate(variables, iterations):
        seen.append(iterations)
        return {"w_sum": float(variables["w"].sum())}

    evaluator = pstrain.evaluator.SidecarEvaluator(evaluate, str(tmp_path), max_evaluations=3,
                                                   poll_interval_s=0.05)
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
    from pstrain.evaluator import restored_iterations

    with pytest.raises(RuntimeError, match="`iterations` cannot be loaded"):
        restored_iterations({"w": np.zeros(2)})


async def test_evaluator_as_a_serve_role(ps_server, tmp_path):
    strategy = make_strategy([ps_server])
    async with strategy.scope():
        w = pstrain.Variable(np.ones(2), name="w")
        opt = pstrain.optimizers.SGD(1.0)
    await opt.apply_gradients([(np.ones(2), w)])
    await CheckpointManager(Checkpoint(w=w, optimizer=opt), str(tmp_path / "run")).save()
    script = tmp_path / "eval.py"
    script.write_text("def evaluate(variables, iterations):\n    return {'w0': float(variables['w'][0])}\n")
    result = subprocess.run([sys.executable, "-m", "pstrain.cli", "serve", "--role", "evaluator",
                             "--checkpoint-dir", str(tmp_path / "run"), "--eval-script", str(script),
                             "--max-evaluations", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ckpt-1 iterations=1 {'w0': 0.0}" in result.stdout
