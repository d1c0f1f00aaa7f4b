"""``pstrain demo``: the main job, end to end on a local cluster it starts itself.

Trains the W4 CTR model (a 1M x 16 embedding table sharded over the ps,
Adagrad on the ps) for about a minute with a progress bar, checkpoints as it
goes, evaluates on held-out data, draws the loss curve, prints where
everything is, and stops every process it started. Ctrl-C stops after the
steps in flight; the checkpoints already written stay intact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .cli.arguments import positive_int

__all__ = ["add_demo_parser"]


def add_demo_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a sparse CTR model on a local cluster (about a minute)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--ps", type=positive_int, default=2, help="parameter-server processes (default 2)")
    p.add_argument(
        "--steps", type=positive_int, default=8000, help="training steps of 512 examples (default 8000)"
    )
    p.add_argument("--output", default="demo-output", help="where checkpoints, plot and results go")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=500,
        metavar="STEPS",
        help="steps between checkpoints (default 500)",
    )
    p.add_argument(
        "--dashboard",
        nargs="?",
        const="127.0.0.1:0",
        default=None,
        metavar="HOST:PORT",
        help="serve the live dashboard (default 127.0.0.1, any free port) and print its one-time login URL",
    )
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.checkpoint_every < 1:
        raise SystemExit(
            f"pstrain demo: --checkpoint-every must be at least 1 step, got {args.checkpoint_every}"
        )
    from ._transport.bridge import run

    return run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    # The job's modules load here, not with the module: every ``pstrain`` command builds this
    # parser, and ``pstrain serve`` starts in half the time without the coordinator's side.
    from . import dashboard
    from ._checkpoint.checkpoint import Checkpoint
    from ._checkpoint.manager import CheckpointManager
    from ._coordinator.coordinator import ClusterCoordinator
    from ._distribute.strategy import ParameterServerStrategy
    from ._training import summary
    from ._training.data import Dataset
    from ._training.optimizers import Adagrad
    from ._variables.partitioners import FixedShardsPartitioner
    from .ctr import BATCH, CTRModel, evaluate, make_step, synthetic
    from .launch import LocalCluster
    from .progress import Progress

    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n_train = min(args.steps, 600) * BATCH  # the training set, repeated

    def say(*parts: Any) -> None:
        print(*parts, flush=True)

    say(f"pstrain demo: starting {args.ps} ps and {args.workers} workers on 127.0.0.1 ...")
    # Ctrl-C: pstrain.run lets the steps in flight finish, says which checkpoint was kept
    # and exits 130 (the servers, in their own session, are stopped by the cluster's exit).
    async with LocalCluster(num_ps=args.ps, num_workers=args.workers, checkpoint_root=out) as cluster:
        strategy = ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(args.ps)
        )
        coordinator = ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():
            model = CTRModel()
            opt = Adagrad(0.05, initial_accumulator_value=0.1)
        manager = CheckpointManager(
            Checkpoint(model=model, optimizer=opt), str(out / "checkpoints"), max_to_keep=3
        )
        metrics_at = await coordinator.serve_metrics()
        token_file = out / "cluster-token"
        token_file.write_text(cluster.token + "\n")
        token_file.chmod(0o600)
        say(
            f"cluster up: ps {cluster.cluster_spec.job_tasks('ps')}, workers "
            f"{cluster.cluster_spec.job_tasks('worker')}; coordinator metrics at "
            f"http://{metrics_at}/metrics\n  read them with the cluster token as a bearer "
            f'header: curl -H "Authorization: Bearer $(cat {token_file})" '
            f"http://{metrics_at}/metrics"
        )
        if args.dashboard is not None:
            host, _, port = args.dashboard.rpartition(":")
            url = await dashboard.serve_dashboard(coordinator, host or "127.0.0.1", int(port or 0))
            say(f"dashboard (one-time login URL; open it once): {url}")
        writer = summary.create_file_writer(str(out / "tensorboard"))
        writer.set_as_default()
        say(f"TensorBoard scalars: tensorboard --logdir {out / 'tensorboard'}")

        def dataset_fn() -> Dataset:
            (ids, dense_x, y), _ = synthetic(n_train, 0)
            return Dataset.from_tensor_slices((ids, dense_x, y)).shuffle(50_000).repeat().batch(BATCH)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        step = make_step(model, opt)
        losses: list[float] = []
        chunk = args.checkpoint_every
        started = time.perf_counter()
        with Progress(args.steps, "training", quiet=args.quiet) as bar:
            while len(losses) < args.steps:
                n = min(chunk, args.steps - len(losses))
                t0 = time.perf_counter()
                rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(n)]
                for rv in rvs:
                    losses.append(await rv)
                    summary.scalar("train/loss", losses[-1], step=len(losses))
                    bar.update(1)
                    if len(losses) % 25 == 0:
                        in_chunk = len(losses) % chunk or chunk
                        rate_now = in_chunk * BATCH / (time.perf_counter() - t0)
                        bar.update(0, loss=f"{np.mean(losses[-200:]):.3f}", examples_per_s=f"{rate_now:,.0f}")
                await coordinator.join()
                await manager.save()
        elapsed = time.perf_counter() - started
        _, test = synthetic(n_train)
        held_out = await evaluate(model, test)
        base = float(test[2].mean())
        base_loss = -(base * math.log(base) + (1 - base) * math.log(1 - base))
        summary.scalar("eval/held_out_log_loss", held_out, step=len(losses))
        summary.scalar("eval/base_rate_log_loss", base_loss, step=len(losses))
        writer.close()
        await coordinator.close()
    rate = len(losses) * BATCH / elapsed
    plot = _plot(out / "loss.png", losses, held_out, base_loss)
    results = {
        "steps": len(losses),
        "examples_per_s": round(rate),
        "held_out_log_loss": round(held_out, 4),
        "base_rate_log_loss": round(base_loss, 4),
        "seconds": round(elapsed, 1),
        "checkpoint": manager.latest_checkpoint,
        "plot": plot,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        f"\ntrained {len(losses)} steps ({len(losses) * BATCH:,} examples) in {elapsed:.0f} s: "
        f"{rate:,.0f} examples/s"
    )
    print(f"held-out log loss {held_out:.4f} (predicting the base rate: {base_loss:.4f})")
    print(f"checkpoint: {manager.latest_checkpoint}")
    print(f"loss curve: {plot}")
    print(f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    print(f"results:    {out / 'results.json'}")
    print("every process the demo started has stopped.")
    return 0 if held_out < base_loss else 1


def _plot(path: Path, losses: list[float], held_out: float, base_loss: float) -> str:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install 'pstrain[bench]')", file=sys.stderr)
        return "(not drawn: matplotlib missing)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(losses) // 100)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if losses else np.zeros(0)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(np.arange(len(losses)), losses, alpha=0.25, label="loss per step")
    ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=f"mean of {window}")
    ax.axhline(held_out, color="green", linestyle="--", label=f"held-out log loss {held_out:.4f}")
    ax.axhline(base_loss, color="grey", linestyle=":", label=f"predicting the base rate {base_loss:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training log loss")
    ax.set_title("pstrain demo: sparse CTR model, 2 ps + 2 workers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return os.fspath(path)
