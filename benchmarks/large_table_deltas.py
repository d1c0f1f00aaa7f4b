"""W7 with delta checkpoints: the 25,000,000 x 32 table (W4's model and data) on 2 ps, a full
base, then a delta every ``--interval`` seconds while training runs; then base + deltas
restored into a fresh cluster, against a plain read of the same files measured in the same run.

Figures (results/W7-deltas.jsonl, medians over the deltas): training speed while a delta is
written against the interval before it, with the most the writers' own CPU leaves it
(:func:`cpu_bound`); delta bytes per minute of training; restore of base +
``--deltas`` deltas against a plain read of the same bytes (page cache dropped before each, as
root); each ps's peak RSS over the table and slots it holds. results/W7-deltas.png plots each
ps's RSS over time with the deltas marked.

    python benchmarks/large_table_deltas.py [--rows 25000000] [--deltas 10] [--interval 10]
                                            [--write-s S]

Each delta is spread over ``--write-s`` seconds (by default what ``CheckpointManager`` takes
for ``--interval``: a quarter of it) and starts ``interval - write_s`` seconds after the one
before, as the manager schedules them, so training runs alone ``interval - 2 * write_s``
seconds between deltas.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pstrain
from pstrain._checkpoint.manager import DELTA_WRITE_SHARE
from pstrain.ctr import BATCH, CTRModel, make_step, synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, machine_cpu, stat_cpu_seconds  # noqa: E402
from dynamic_tables import rss_mib  # noqa: E402
from large_table import Sampler, drop_caches, parallel, plain_read, plot_rss, restore  # noqa: E402

EXTRA = ["--max-variable-bytes", str(8 << 30)]


def _read_files(paths: list[str]) -> None:
    for path in paths:
        plain_read(path)


def side_threads_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of every thread but the main one of processes ``pids``:
    on a ps, the save thread that finds, gathers and writes a delta (its O_DIRECT writes'
    kernel time included), and the few other threads it has."""
    return sum(
        stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        for pid in pids
        for tid in os.listdir(f"/proc/{pid}/task")
        if int(tid) != pid
    )


def cpu_bound(round_: dict) -> float:
    """The best ratio (speed while a delta is written over speed before it) that training could
    reach given the CPU the writers used: the cores left over the window (the machine's, less
    the ps's save threads' CPU beyond their rate before it) against the cores busy before it,
    at most 1. An upper bound: it counts neither what the serving loops do for the save
    (keeping old rows) nor what the writes cost the cores through memory and cache."""
    c = round_["cpu"]
    window = round_["delta_s"]
    extra = c["side_during"] - c["side_before"] / c["before_s"] * window
    left = os.cpu_count() - max(0.0, extra) / window
    return min(1.0, left / c["busy_cores_before"])


async def train_with_deltas(args, directory: str) -> dict:
    async with pstrain.LocalCluster(
        num_ps=2, num_workers=2, extra_args=EXTRA, checkpoint_root=directory
    ) as cluster:
        ps_pids = [cluster.pid("ps", i) for i in range(2)]
        sampler = Sampler(ps_pids)
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():
            model = CTRModel(rows=args.rows, dim=args.dim, name="w7")
            opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
        step = make_step(model, opt)
        rows = args.rows

        def dataset_fn():
            (ids, dense_x, y), _ = synthetic(1000 * BATCH, 0, rows=rows)
            return (
                pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y))
                .shuffle(50_000)
                .repeat()
                .batch(BATCH)
            )

        it = iter(coordinator.create_per_worker_dataset(dataset_fn))
        for _ in range(50):
            coordinator.schedule(step, args=(it,))
        await coordinator.join()  # the slots exist now: the ps hold table + slots
        peers = pstrain.rpc.ChannelPool(cluster.cluster_spec, cluster.token)
        held = [(await peers.channel("ps", i).statistics())["bytes"] for i in range(2)]
        await peers.close()
        ckpt = pstrain.Checkpoint(model=model, optimizer=opt)
        manager = pstrain.checkpoint.CheckpointManager(
            ckpt, directory, max_to_keep=1, deltas_per_base=args.deltas + 1, delta_write_s=args.write_s
        )
        t = time.perf_counter()
        base = await manager.save()
        base_s = time.perf_counter() - t
        rounds = []
        marks = []
        steps_total, train_s = 0, 0.0
        for _ in range(args.deltas):
            # Training alone until the next delta is due (the manager's schedule).
            t0 = time.perf_counter()
            side_start, (busy_start, all_start) = side_threads_cpu(ps_pids), machine_cpu()
            done = 0
            while time.perf_counter() - t0 < args.interval - 2 * args.write_s:
                for _ in range(20):
                    coordinator.schedule(step, args=(it,))
                await coordinator.join()
                done += 20
            alone_s = time.perf_counter() - t0
            side0, (busy0, all0) = side_threads_cpu(ps_pids), machine_cpu()
            # A delta, with training going on until it is written.
            d0 = time.perf_counter()
            writing = asyncio.ensure_future(manager.save_delta())
            await asyncio.sleep(0)  # its first requests go out before the next steps
            during = 0
            while not writing.done():
                for _ in range(20):
                    coordinator.schedule(step, args=(it,))
                await coordinator.join()
                during += 20
            d1 = time.perf_counter()
            side1 = side_threads_cpu(ps_pids)
            path = await writing
            marks.append((d0 - sampler.t0, d1 - sampler.t0))
            size = sum(
                os.path.getsize(os.path.join(directory, f))
                for f in os.listdir(directory)
                if f.startswith(os.path.basename(path) + ".")
            )
            rounds.append(
                {
                    "alone": done * BATCH / alone_s,
                    "during": during * BATCH / (d1 - d0),
                    "delta_s": d1 - d0,
                    "bytes": size,
                    "cpu": {
                        "before_s": alone_s,
                        "side_before": side0 - side_start,
                        "side_during": side1 - side0,
                        "busy_cores_before": ((busy0 - busy_start) / (all0 - all_start) * os.cpu_count()),
                    },
                }
            )
            steps_total += done + during
            train_s += d1 - t0
        sampler.stop()
        peaks = [rss_mib(p, "VmHWM") for p in ps_pids]
        latest = manager.latest_checkpoint
        await manager.close()
        await coordinator.close()
    return {
        "base": base,
        "base_s": base_s,
        "latest": latest,
        "rounds": rounds,
        "held": held,
        "peaks": peaks,
        "samples": sampler.samples,
        "marks": marks,
        "train_s": train_s,
        "steps": steps_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=25_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--deltas", type=int, default=10)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds of training between deltas")
    parser.add_argument(
        "--write-s",
        type=float,
        default=None,
        help="seconds each ps spreads a delta's write over (CheckpointManager's "
        "delta_write_s; by default the manager's for --interval; 0: as fast "
        "as it goes)",
    )
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    if args.write_s is None:
        args.write_s = DELTA_WRITE_SHARE * args.interval
    if not 0 <= 2 * args.write_s < args.interval:
        parser.error("--write-s must be from 0 to less than half of --interval")
    directory = tempfile.mkdtemp(prefix="w7d-", dir=args.dir or str(Path(__file__).resolve().parent))
    try:
        r = pstrain.run(train_with_deltas(args, directory))
        files = sorted(
            os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")
        )
        total = sum(os.path.getsize(f) for f in files)
        by_ps = [[f for f in files if f".ps{i}." in f] for i in range(2)]
        by_ps[0] += [f for f in files if ".ps" not in os.path.basename(f)]  # the coordinator's own
        drop_caches()
        read_s = parallel(_read_files, [(group,) for group in by_ps])
        cold = drop_caches()
        rr = pstrain.run(restore(args, directory, r["latest"]))
        rounds = r["rounds"]
        ratios = [x["during"] / x["alone"] for x in rounds]
        common = {
            "workers": 2,
            "ps": 2,
            "rows": args.rows,
            "dim": args.dim,
            "batch": BATCH,
            "deltas": len(rounds),
            "interval_s": args.interval,
            "write_s": args.write_s,
            "page_cache_dropped": cold,
        }
        emit(
            {
                **common,
                "metric": "ratio_during_delta",
                "value": round(statistics.median(ratios), 3),
                "examples_per_s_alone": round(statistics.median(x["alone"] for x in rounds), 1),
                "examples_per_s_during_delta": round(statistics.median(x["during"] for x in rounds), 1),
                "ratios": [round(x, 3) for x in ratios],
                "delta_s": [round(x["delta_s"], 2) for x in rounds],
                "cpu_bound_ratio": round(statistics.median(cpu_bound(x) for x in rounds), 3),
                "save_threads_cpu_s": round(statistics.median(x["cpu"]["side_during"] for x in rounds), 3),
                "busy_cores_before": round(
                    statistics.median(x["cpu"]["busy_cores_before"] for x in rounds), 2
                ),
            },
            "W7-deltas",
        )
        per_min = sum(x["bytes"] for x in rounds) / r["train_s"] * 60
        emit(
            {
                **common,
                "metric": "delta_mib_per_min",
                "value": round(per_min / 2**20, 1),
                "delta_mib": [round(x["bytes"] / 2**20, 1) for x in rounds],
                "table_and_slots_mib": round(sum(r["held"]) / 2**20),
                "train_s": round(r["train_s"], 1),
                "steps": r["steps"],
            },
            "W7-deltas",
        )
        emit(
            {
                **common,
                "metric": "restore_ratio_to_plain_read",
                "value": round(read_s / rr["restore_s"], 3),
                "restore_s": round(rr["restore_s"], 2),
                "plain_read_s": round(read_s, 2),
                "bytes": total,
                "path": os.path.basename(r["latest"]),
                "restore_peak_rss_over_held": round(
                    max(pk * 2**20 / h for pk, h in zip(rr["peaks"], r["held"])), 3
                ),
            },
            "W7-deltas",
        )
        emit(
            {
                **common,
                "metric": "peak_rss_over_held",
                "value": round(max(pk * 2**20 / h for pk, h in zip(r["peaks"], r["held"])), 3),
                "peak_rss_mib_per_ps": [round(p) for p in r["peaks"]],
                "held_mib_per_ps": [round(h / 2**20) for h in r["held"]],
                "base_save_s": round(r["base_s"], 1),
            },
            "W7-deltas",
        )
        plot_rss(
            r["samples"],
            r["held"],
            r["marks"],
            "delta written",
            "W7 with deltas: each ps's RSS, a delta every interval during training",
            "W7-deltas.png",
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
