"""The coordinator of one fault-matrix drill (``tests/system/test_fault_matrix.py``): a real job.

It trains one of three models for ``--steps`` steps with TF's recovery recipe,
so that it can be SIGKILLed and started again at any moment:

* on start, ``restore_or_initialize`` the latest checkpoint (a first one is
  written before the first step) and go on from ``optimizer.iterations``;
* each step is scheduled ``exactly_once`` and awaited before the next, on a
  batch that is a function of the step number alone, so the run is
  deterministic whichever worker runs each step and however often a step is
  retried;
* a checkpoint every ``--every`` steps;
* a ps lost mid-run (``UnavailableError``): wait for it, restore the latest
  checkpoint, go on from its step (the documented semantics: the steps after
  that checkpoint run again);
* on SIGUSR1 the largest variable moves to the other ps, on SIGUSR2 the ps at
  ``--join`` joins and a share of the variables moves to it, while steps run
  (``moved ...``, ``joined ps N`` or ``... failed: ...`` is printed);
* at the end, write the whole state (variables, slots, table rows, the step)
  to ``--out`` for the harness to compare with a run without faults, and say how many
  of each dynamic table's rows are on the ps's disks (``table NAME: R rows, D on disk``).

It prints ``step N on W`` after each step (W: the worker that ran it) and ``done``
at the end.

    python tests/system/fault_matrix_job.py --model numpy --cluster c.json --dir /tmp/x --out /tmp/x/final
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import signal
import sys
import time

import numpy as np

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager
from pstrain.errors import CancelledError, NotFoundError, PstrainError, UnavailableError

FEATURES, DENSE, DIM, ROWS, BATCH = 26, 13, 8, 20_000, 64


def batch(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch of ``step``: the same in every run, on every worker."""
    rng = np.random.default_rng(step)
    ids = rng.integers(0, ROWS, (BATCH, FEATURES)).astype(np.int64)
    dense = rng.standard_normal((BATCH, DENSE)).astype(np.float32)
    y = (rng.random(BATCH) < 0.3).astype(np.float32)
    return ids, dense, y


async def numpy_model(strategy):
    """W4's hand-written numpy model (``pstrain.ctr``), a smaller table."""
    from pstrain.ctr import CTRModel, make_step

    async with strategy.scope():
        model = CTRModel(rows=ROWS, dim=DIM, name="ctr")
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
    inner = make_step(model, opt)

    async def step(i):
        return await inner(iter([batch(i)]))

    return step, model, opt


async def jax_model(strategy):
    import jax
    import jax.numpy as jnp

    import pstrain.jax as pjax
    from pstrain.ctr import CTRModel

    async with strategy.scope():
        model = CTRModel(rows=ROWS, dim=DIM, name="ctr")
        opt = pstrain.optimizers.Adam(learning_rate=0.01)

    def loss_fn(params, dense_x, y):
        n = dense_x.shape[0]
        x = jnp.concatenate([params["emb"].reshape(n, FEATURES * DIM), dense_x], axis=1)
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        z = (h @ params["w2"] + params["b2"])[:, 0]
        return jnp.mean(jnp.logaddexp(0.0, z) - y * z)

    async def step(i):
        ids, dense_x, y = batch(i)
        params = {
            "emb": pjax.lookup(model.table, ids),
            "w1": model.w1,
            "b1": model.b1,
            "w2": model.w2,
            "b2": model.b2,
        }
        loss, grads = await pjax.value_and_grad(loss_fn)(params, dense_x, y)
        await opt.apply_gradients(grads)
        return loss

    return step, model, opt


async def torch_model(strategy):
    """A PyTorch model whose ids go through a DynamicEmbedding (rows admitted as seen)."""
    import torch

    import pstrain.torch as ptorch

    class Net(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            torch.manual_seed(0)
            self.emb = ptorch.Embedding(None, DIM, table=table)
            self.tower = torch.nn.Sequential(
                torch.nn.Linear(FEATURES * DIM + DENSE, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )

        def forward(self, ids, dense_x):
            x = torch.cat([self.emb(ids).flatten(1), dense_x], 1)
            return self.tower(x)[:, 0]

    async with strategy.scope():
        table = pstrain.DynamicEmbedding(
            DIM, name="items", initializer=pstrain.initializers.RandomUniform(-0.05, 0.05, seed=3)
        )
        TABLES.append(table)
        net = Net(table)
        remote = ptorch.RemoteModule(net)
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)

    async def step(i):
        torch.set_num_threads(1)  # the same arithmetic on every worker
        ids, dense_x, y = batch(i)
        await remote.pull({net.emb: ids})
        logits = net(torch.from_numpy(ids), torch.from_numpy(dense_x))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(y))
        loss.backward()
        await opt.apply_gradients(remote.gradients())
        return loss.item()

    return step, net, opt


MODELS = {"numpy": numpy_model, "jax": jax_model, "torch": torch_model}
#: The model's dynamic tables: where their rows are is printed at the end.
TABLES: list[pstrain.DynamicEmbedding] = []


async def restore_latest(manager: CheckpointManager, deadline_s: float = 60.0) -> None:
    """Restore the latest checkpoint, waiting (with back-off) for a ps still restarting."""
    pause, give_up = 0.1, time.monotonic() + deadline_s
    while True:
        try:
            (await manager.checkpoint.restore(manager.latest_checkpoint)).assert_consumed()
            return
        except (UnavailableError, NotFoundError) as exc:
            if time.monotonic() > give_up:
                raise
            print(f"waiting for the ps to restore: {exc}", file=sys.stderr, flush=True)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


async def main(args: argparse.Namespace) -> None:
    with open(args.cluster) as f:
        spec = json.load(f)["cluster"]
    resolver = pstrain.SimpleClusterResolver(spec, token=args.token or os.environ.get("PSTRAIN_TOKEN"))
    strategy = pstrain.ParameterServerStrategy(
        resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
    )
    coordinator = pstrain.ClusterCoordinator(
        strategy, worker_timeout_s=2.0, heartbeat_s=0.25, ps_timeout_s=3.0, probe_max_s=0.5
    )
    train_step, model, opt = await MODELS[args.model](strategy)
    work_s = args.work_ms / 1000

    async def step_fn(i):
        await asyncio.sleep(work_s)  # the step's compute: faults land while steps run
        await train_step(i)
        return pstrain.get_current_worker_index()

    ckpt = Checkpoint(model=model, optimizer=opt)
    manager = CheckpointManager(ckpt, args.dir, max_to_keep=3)
    if manager.latest_checkpoint is None:
        await manager.save(checkpoint_number=0)  # a ps lost before the first save restores this
    else:
        await restore_latest(manager)
    step = int(await opt.iterations.numpy())
    print(f"start {step}", flush=True)
    changes: set[asyncio.Task[None]] = set()

    async def change(what: str) -> None:
        """A ps change while the steps run (the harness's ``ps_move`` and ``ps_join``)."""
        try:
            if what == "join":
                index = await coordinator.add_ps(args.join)
                print(f"joined ps {index}", flush=True)
            else:  # the largest variable goes to the other ps it could be on
                placed = strategy.placement.placed
                key = max(placed, key=lambda k: placed[k][1])
                now = coordinator.ps.placement.ps_of(key, placed[key][0])
                to = next(k for k in coordinator.ps.placement.active() if k != now)
                await coordinator.ps.move([key], to)
                print(f"moved {key} from ps {now} to ps {to}", flush=True)
        except PstrainError as exc:  # it changed nothing: the run goes on as it was
            print(f"{what} failed: {type(exc).__name__}: {exc}", flush=True)

    def signalled(what: str) -> None:
        task = asyncio.ensure_future(change(what))
        changes.add(task)
        task.add_done_callback(changes.discard)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, signalled, "move")
    loop.add_signal_handler(signal.SIGUSR2, signalled, "join")
    print("ready for changes", flush=True)
    while step < args.steps:
        try:
            rv = coordinator.schedule(step_fn, args=(step,), exactly_once=True)
            await coordinator.join()
            worker = await rv
            if (step + 1) % args.every == 0:  # a ps lost mid-save: recovered like mid-step
                await manager.save(checkpoint_number=step + 1)
        except (UnavailableError, NotFoundError, CancelledError) as exc:
            print(f"recovering at step {step}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            await restore_latest(manager)
            step = int(await opt.iterations.numpy())
            print(f"restored {step}", flush=True)
            continue
        step += 1
        print(f"step {step} on {worker}", flush=True)
    for task in list(changes):  # a change under way ends before the state is written
        await task
    for stale in glob.glob(glob.escape(args.out) + ".*"):  # an earlier incarnation's
        os.remove(stale)
    await ckpt.write(args.out)
    for table in TABLES:  # (on ps with a memory budget, some of its rows are on their disks)
        stats = await table.statistics()
        print(f"table {table.name}: {stats['rows']} rows, {stats.get('cold_rows', 0)} on disk", flush=True)
    await coordinator.close()
    print("done", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--work-ms", type=float, default=20.0)
    parser.add_argument("--token", default=None)
    parser.add_argument("--join", default=None, help="the address of a ps that joins on SIGUSR2")
    try:
        pstrain.run(main(parser.parse_args()))
    except PstrainError as exc:
        print(f"job failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
