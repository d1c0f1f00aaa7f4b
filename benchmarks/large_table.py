"""W7: a 25,000,000 x 32 table (W4's model and data) on 2 ps, saved while training runs and
restored into a fresh cluster, against a plain write and read of the same bytes to the same
disk measured in the same run.

Prints one JSON line per figure (results/W7.jsonl) and plots each ps's RSS over time with
the save marked (results/W7.png). Needs about 8 GiB of memory and 13 GiB of disk under
``--dir`` (default: a temporary directory beside this file); run as root to drop the page
cache before each read (otherwise reads may come from memory, and the note says so).

    python benchmarks/large_table.py [--steps 1000] [--rows 25000000] [--dim 32]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import pstrain
from pstrain.ctr import BATCH, CTRModel, make_step, synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit  # noqa: E402
from dynamic_tables import rss_mib  # noqa: E402

CHUNK = 16 << 20


def _plain_write(path: str, size: int) -> None:
    buf = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, CHUNK)
            f.write(buf[:n].data)
            left -= n
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: str) -> None:
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def parallel(target, args_list) -> float:
    """Seconds for the processes ``target(*args)`` (one per args) to finish together."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args_list]
    t = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__} failed")
    return time.perf_counter() - t


class Sampler:
    """Each ps's RSS every 0.2 s, on a thread."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):  # the sampling period
            self.samples.append((time.perf_counter() - self.t0, [rss_mib(p) for p in self.pids]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def train_and_save(args, directory: str) -> dict:
    extra = ["--max-variable-bytes", str(8 << 30)]
    async with pstrain.LocalCluster(
        num_ps=2, num_workers=2, extra_args=extra, checkpoint_root=directory
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
            (ids, dense_x, y), _ = synthetic(args.steps * BATCH, 0, rows=rows)
            return (
                pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y))
                .shuffle(50_000)
                .repeat()
                .batch(BATCH)
            )

        it = iter(coordinator.create_per_worker_dataset(dataset_fn))
        warm = 50
        for _ in range(warm):
            coordinator.schedule(step, args=(it,))
        await coordinator.join()  # the slots exist now: the ps hold table + slots
        peers = pstrain.rpc.ChannelPool(cluster.cluster_spec, cluster.token)
        held = [(await peers.channel("ps", i).statistics())["bytes"] for i in range(2)]
        await peers.close()

        def schedule(n: int) -> None:
            for _ in range(n):
                coordinator.schedule(step, args=(it,))

        before = args.steps // 3
        t0 = time.perf_counter()
        schedule(before)
        await coordinator.join()
        rate_before = before * BATCH / (time.perf_counter() - t0)
        ckpt = pstrain.Checkpoint(model=model, optimizer=opt)
        save_t0 = time.perf_counter()
        saving = asyncio.ensure_future(ckpt.write(os.path.join(directory, "w7")))
        await asyncio.sleep(0)  # the save's first request goes out before the next steps
        during = 0
        while not saving.done():  # keep training while the save runs
            schedule(20)
            await coordinator.join()
            during += 20
        save_t1 = time.perf_counter()  # the save and the steps run during it are done
        path = await saving
        rate_during = during * BATCH / (save_t1 - save_t0)
        rest = max(0, args.steps - warm - before - during)
        schedule(rest)
        await coordinator.join()
        idle_t0 = time.perf_counter()  # the same save with training stopped
        await ckpt.write(os.path.join(directory, "idle"))
        idle_s = time.perf_counter() - idle_t0
        for f in os.listdir(directory):
            if f.startswith("idle"):
                os.unlink(os.path.join(directory, f))
        sampler.stop()
        peaks = [rss_mib(p, "VmHWM") for p in ps_pids]
        await coordinator.close()
    files = [os.path.join(directory, f) for f in os.listdir(directory) if f.startswith("w7.ps")]
    written = sum(os.path.getsize(f) for f in files)
    return {
        "path": path,
        "rate_before": rate_before,
        "rate_during": rate_during,
        "save_s": save_t1 - save_t0,
        "idle_save_s": idle_s,
        "written": written,
        "files": files,
        "held": held,
        "peaks": peaks,
        "samples": sampler.samples,
        "save_mark": (save_t0 - sampler.t0, save_t1 - sampler.t0),
    }


async def restore(args, directory: str, path: str) -> dict:
    extra = ["--max-variable-bytes", str(8 << 30)]
    async with pstrain.LocalCluster(
        num_ps=2, num_workers=1, extra_args=extra, checkpoint_root=directory
    ) as cluster:
        ps_pids = [cluster.pid("ps", i) for i in range(2)]
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        async with strategy.scope():
            model = CTRModel(rows=args.rows, dim=args.dim, name="w7-restored")
            opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
        coordinator = pstrain.ClusterCoordinator(strategy)
        step = make_step(model, opt)
        rows = args.rows
        it = iter(
            coordinator.create_per_worker_dataset(lambda: iter([synthetic(BATCH, 0, rows=rows)[0]] * 4))
        )
        await coordinator.schedule(lambda it: None, args=(it,))  # the worker's data, built first
        t = time.perf_counter()
        status = await pstrain.Checkpoint(model=model, optimizer=opt).restore(path)
        # The slots are restored when the optimizer creates them: one step does.
        await coordinator.schedule(step, args=(it,))
        elapsed = time.perf_counter() - t
        status.assert_consumed()
        peaks = [rss_mib(p, "VmHWM") for p in ps_pids]
        await coordinator.close()
    return {"restore_s": elapsed, "peaks": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=25_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="w7-", dir=args.dir or str(Path(__file__).resolve().parent))
    try:
        r = pstrain.run(train_and_save(args, directory))
        sizes = [os.path.getsize(f) for f in sorted(r["files"])]
        plain = [os.path.join(directory, f"plain{i}") for i in range(len(sizes))]
        write_s = parallel(_plain_write, list(zip(plain, sizes)))
        cold = drop_caches()
        read_s = parallel(plain_read, [(p,) for p in plain])
        for p in plain:
            os.unlink(p)
        drop_caches()
        rr = pstrain.run(restore(args, directory, r["path"]))
        total = sum(sizes)
        mib = total / 2**20
        common = {
            "workers": 2,
            "ps": 2,
            "rows": args.rows,
            "dim": args.dim,
            "steps": args.steps,
            "batch": BATCH,
            "page_cache_dropped": cold,
        }
        emit(
            {
                **common,
                "metric": "examples_per_s",
                "value": round(r["rate_before"], 1),
                "during_save": round(r["rate_during"], 1),
                "ratio_during_save": round(r["rate_during"] / r["rate_before"], 3),
            },
            "W7",
        )
        emit(
            {
                **common,
                "metric": "peak_rss_over_held",
                "value": round(max(pk * 2**20 / h for pk, h in zip(r["peaks"], r["held"])), 3),
                "peak_rss_mib_per_ps": [round(p) for p in r["peaks"]],
                "held_mib_per_ps": [round(h / 2**20) for h in r["held"]],
            },
            "W7",
        )
        emit(
            {
                **common,
                "metric": "checkpoint_write_mib_s",
                "value": round(mib / r["save_s"], 1),
                "plain_write_mib_s": round(mib / write_s, 1),
                "ratio_to_plain": round(write_s / r["save_s"], 3),
                "bytes": total,
                "save_s": round(r["save_s"], 2),
                "idle_save_mib_s": round(mib / r["idle_save_s"], 1),
                "idle_ratio_to_plain": round(write_s / r["idle_save_s"], 3),
            },
            "W7",
        )
        emit(
            {
                **common,
                "metric": "restore_mib_s",
                "value": round(mib / rr["restore_s"], 1),
                "plain_read_mib_s": round(mib / read_s, 1),
                "ratio_to_plain": round(read_s / rr["restore_s"], 3),
                "restore_s": round(rr["restore_s"], 2),
                "restore_peak_rss_mib_per_ps": [round(p) for p in rr["peaks"]],
            },
            "W7",
        )
        plot_rss(
            r["samples"],
            r["held"],
            [r["save_mark"]],
            "checkpoint save",
            "W7: each ps's RSS (25M x 32 table + Adagrad) with a save during training",
            "W7.png",
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def plot_rss(
    samples: list, held: list[int], spans: list[tuple[float, float]], span_label: str, title: str, name: str
) -> None:
    """Each ps's RSS over time against 1.3x what it holds, with ``spans`` shaded; to
    results/<name>."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ts = [t for t, _ in samples]
    for i in range(len(held)):
        ax.plot(ts, [s[i] / 1024 for _, s in samples], label=f"ps {i} RSS")
        ax.axhline(held[i] / 2**30, color="grey", linestyle=":", linewidth=1)
    ax.axhline(1.3 * max(held) / 2**30, color="red", linestyle="--", label="1.3 x table + slots")
    for k, (a, b) in enumerate(spans):
        ax.axvspan(a, b, color="orange", alpha=0.25, label=span_label if k == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / name)
    print(f"wrote {RESULTS / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
