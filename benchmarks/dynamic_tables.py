"""W6: unbounded 64-bit ids (WORKLOADS.md), three tables, and W4 measured in the same run.

Variants: (a) a DynamicEmbedding with no limit; (b) capacity 500,000 rows in all,
admission after 2 sightings, LRU eviction; (c) the W4 approach: ids hashed
(``key % 500,000``) into a fixed 500,000-row table. 2 ps, 2 workers (each training on
its own shard of the examples), batch 512, Adagrad 0.05 / 0.1 on the ps, the W4 model
otherwise. Each prints a JSON line
(examples/s, held-out log loss, rows held, peak RSS of each ps, bytes per step)
and ``results/W6.png`` plots held-out loss against rows held.

    python benchmarks/dynamic_tables.py [--steps 2000] [--variants a,b,c] [--runs 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import pstrain
from pstrain._formats.numerics.idhash import mix64
from pstrain.ctr import BATCH, DENSE, DIM, FEATURES, CTRModel, evaluate, log_loss, make_step, synthetic

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "examples")]
from common import RESULTS, emit, median, plot  # noqa: E402
from ctr_embedding import ps_wire_bytes  # noqa: E402
from train_embedding import cpu_seconds, run as run_w4  # noqa: E402

FIXED_ROWS = 500_000
CAPACITY = 500_000


def w6_data(n_train: int, n_test: int = 20_000):
    """WORKLOADS.md W6: zipf ids mixed over the 64-bit space, a per-key teacher."""
    rng = np.random.default_rng(0)
    t_dense = rng.standard_normal(DENSE)
    n = n_train + n_test
    raw = rng.zipf(1.2, (n, FEATURES)).astype(np.uint64)
    f = np.arange(1, FEATURES + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = mix64(raw * np.uint64(0x9E3779B97F4A7C15) + f)
    u1 = (mix64(key ^ np.uint64(0xA5A5A5A5A5A5A5A5)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    u2 = (mix64(key ^ np.uint64(0x5A5A5A5A5A5A5A5A)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    t = np.sqrt(-2 * np.log(u1 + 2.0**-54)) * np.cos(2 * np.pi * u2)
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    logit = t.sum(1) / np.sqrt(FEATURES) + dense @ t_dense / np.sqrt(DENSE)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return key, dense, labels, n_train


#: A dynamic table's statistics that count (rather than measure a state): taken over the
#: timed steps alone.
COUNTERS = (
    "looked_up",
    "promoted",
    "made_back",
    "demoted",
    "cold_reads",
    "cold_rows_read",
    "cold_rows_from_page_cache",
    "read_through",
    "admitted",
    "evicted",
    "compacted",
    "refused",
)

#: Variant "w7": W7's table (WORKLOADS.md W9) as a dynamic table: every one of its rows
#: made, and given its Adagrad accumulator, before training; W4's ids into it.
W7_ROWS, W7_DIM = 25_000_000, 32
#: Ids a closure of the fill makes rows of at a time.
FILL_IDS = 1 << 16
#: What each worker trains on (``run_variant``), as the result lines record it: with the
#: whole set on each, both walked the same examples a few steps apart, and a tiered table
#: found each row the second worker looked up in RAM (``docs/benchmarks.md``, W9).
WORKER_DATA = "each worker its shard of the examples"


def w6_model(variant: str, eviction: str = "lru") -> CTRModel:
    """``eviction``: what chooses the hot set of a tiered table without a capacity ("w7"
    and "a"; "b" evicts by LRU, as W6 says)."""
    if variant == "c":
        return CTRModel(rows=FIXED_ROWS, name="w6")
    init = pstrain.initializers.RandomUniform(-0.05, 0.05, seed=0)
    if variant == "w7":
        table = pstrain.DynamicEmbedding(W7_DIM, name="w9/table", initializer=init, eviction=eviction)
        return CTRModel(table=table, dim=W7_DIM)
    extra: dict[str, Any] = {"eviction": eviction}
    if variant != "a":
        extra = {"capacity": CAPACITY, "admit_after": 2, "eviction": "lru"}
    table = pstrain.DynamicEmbedding(DIM, name="w6/dynamic", initializer=init, **extra)
    return CTRModel(table=table, name="w6")


def variant_data(variant: str, n_train: int, n_test: int = 20_000) -> tuple[Any, Any, Any, int]:
    """(ids, dense features, labels, training examples) of ``variant``: W6's data, or W4's
    into W7's table for "w7"."""
    if variant == "w7":
        (ids, dense, labels), (t_ids, t_dense, t_labels) = synthetic(n_train, n_test, rows=W7_ROWS)
        return (
            np.concatenate([ids, t_ids]),
            np.concatenate([dense, t_dense]),
            np.concatenate([labels, t_labels]),
            n_train,
        )
    key, dense, labels, n = w6_data(n_train, n_test)
    return ids_for(variant, key), dense, labels, n


async def fill_table(coordinator: Any, model: CTRModel, opt: Any, rows: int) -> float:
    """Make every row of ``model``'s table (ids 0 to ``rows``), each with its optimizer
    slot (a zero gradient applied), in closures of ``FILL_IDS`` ids on the workers; the
    seconds it took."""
    table = model.table

    async def fill(lo: int, hi: int) -> None:
        ids = np.arange(lo, hi, dtype=np.int64)
        values = await pstrain.embedding_lookup(table, ids)  # (a training lookup: makes the rows)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.zeros_like(values), ids), table)])

    started = time.perf_counter()
    for lo in range(0, rows, FILL_IDS):
        coordinator.schedule(fill, args=(lo, min(rows, lo + FILL_IDS)))
    await coordinator.join()
    return time.perf_counter() - started


def ids_for(variant: str, key: np.ndarray) -> np.ndarray:
    if variant == "c":
        return (key % np.uint64(FIXED_ROWS)).astype(np.int64)
    return key.view(np.int64)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def peak_rss(pids: list[int], period_s: float = 0.1) -> Iterator[list[float]]:
    """Each of ``pids``' largest RSS (MiB) while the ``with`` block runs, sampled every
    ``period_s`` on a thread: the list yielded holds them, as they grow."""
    peak = [rss_mib(p) for p in pids]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(period_s):
            for k, pid in enumerate(pids):
                peak[k] = max(peak[k], rss_mib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


async def run_variant(
    variant: str,
    steps: int,
    cluster_options: dict | None = None,
    sample_s: float = 0.25,
    after: Callable[[Any, Any, Any, Callable[[int], Awaitable[None]]], Awaitable[dict]] | None = None,
    warm: int | None = None,
    inflight: int = 2,
    eviction: str = "lru",
) -> dict:
    """One training of ``variant`` (``cluster_options``: ``LocalCluster``'s, such as a tiered
    ps's budget); each ps's RSS sampled every ``sample_s``; ``after(model, optimizer,
    cluster, train_more)``: more figures, taken when training ends (``await
    train_more(n)``: ``n`` steps more). ``warm``: steps of ``steps`` before the measured
    ones (a tenth by default); "w7" makes every row of its table first. ``inflight``: closures
    in flight per worker (``max_inflight_per_worker``); ``eviction``: :func:`w6_model`'s."""
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, **(cluster_options or {})) as cluster:
        ps_pids = [cluster.pid("ps", i) for i in range(2)]
        pids = [os.getpid(), *ps_pids, *(cluster.pid("worker", i) for i in range(2))]
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        # (W7's table wholly in RAM: a ps doubling 3 GB of arrays and an index of 12 million
        # ids holds its loop for seconds, on two busy cores past the 10 s health deadline)
        timeout = {"ps_timeout_s": 60.0} if variant == "w7" else {}
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=inflight, **timeout)
        at_start = [rss_mib(p) for p in ps_pids]  # each ps before it holds anything
        async with strategy.scope():
            model = w6_model(variant, eviction)
            opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
        step = make_step(model, opt)
        n_train = steps * BATCH

        workers = strategy.cluster_spec.num_tasks("worker")

        def dataset_fn():  # WORKER_DATA
            ids, dense, labels, n = variant_data(variant, n_train, 0)
            return (
                pstrain.data.Dataset.from_tensor_slices((ids[:n], dense[:n], labels[:n]))
                .shard(workers, pstrain.get_current_worker_index())
                .shuffle(50_000)
                .repeat()
                .batch(BATCH)
            )

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        peers = pstrain.rpc.ChannelPool(strategy.cluster_spec, cluster.resolver.token)

        samples: list[tuple[float, list[float]]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(sample_s):  # the sampling period of the RSS curve
                samples.append((time.perf_counter(), [rss_mib(p) for p in ps_pids]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        filled_s = await fill_table(coordinator, model, opt, W7_ROWS) if variant == "w7" else None
        warm = max(1, steps // 10) if warm is None else warm
        for _ in range(warm):
            coordinator.schedule(step, args=(iterator,))
        await coordinator.join()
        # the dynamic table's counters over the timed steps alone (a fill's are not theirs)
        table_stats = model.table.statistics if isinstance(model.table, pstrain.DynamicEmbedding) else None
        stats0 = await table_stats() if table_stats else {}
        bytes0 = await ps_wire_bytes(peers, 2)  # as W4 counts them
        cpu0 = cpu_seconds(pids)
        t0 = time.perf_counter()
        for _ in range(steps - warm):
            coordinator.schedule(step, args=(iterator,))
        await coordinator.join()
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(pids) - cpu0
        stats1 = await table_stats() if table_stats else {}
        bytes_per_step = (await ps_wire_bytes(peers, 2) - bytes0) / (steps - warm)
        stop.set()
        sampler.join()
        ids, dense, labels, n = variant_data(variant, n_train)
        y = labels[n:]
        held_out = await evaluate(model, (ids[n:], dense[n:], y))
        held = FIXED_ROWS if variant == "c" else await model.table.size()
        base = log_loss(np.full_like(y, y.mean()), y)
        peaks = [rss_mib(p, "VmHWM") for p in ps_pids]
        half = [s for s in samples if s[0] >= t0 + elapsed / 2]

        async def train_more(n: int) -> None:  # steps after the measured ones (``after``'s)
            for _ in range(n):
                coordinator.schedule(step, args=(iterator,))
            await coordinator.join()

        more = await after(model, opt, cluster, train_more) if after is not None else {}
        await coordinator.close()
        await peers.close()
        return {
            **more,
            "rss_mib_at_start_per_ps": [round(x) for x in at_start],
            "rss_mib_samples_max_per_ps": [round(max(s[1][k] for s in samples)) for k in range(2)]
            if samples
            else None,
            "variant": variant,
            "eviction": model.table.config["evict"] if table_stats else None,
            "fill_s": filled_s,
            "examples_per_s": (steps - warm) * BATCH / elapsed,
            "held_out_log_loss": held_out,
            "base_rate_log_loss": base,
            "rows_held": held,
            "peak_rss_mib_per_ps": [round(x) for x in peaks],
            "rss_mib_second_half_min_max": [
                round(min(sum(s[1]) for s in half)),
                round(max(sum(s[1]) for s in half)),
            ]
            if half
            else None,
            "cpu_ms_per_step": cpu * 1e3 / (steps - warm),
            "timed_steps": steps - warm,
            "table_over_timed_steps": {
                k: v - stats0.get(k, 0) for k, v in stats1.items() if k in COUNTERS and isinstance(v, int)
            },
            "bytes_per_step": bytes_per_step,
        }


async def lookup_update_cost(
    rows: int, batch: int, iters: int, kernels: str = "compiled", ascending: bool = False
) -> dict:
    """ms per (lookup + Adagrad update) of the same ``batch`` unique rows, from the
    coordinator, in a fixed ``rows`` x 16 table and in a dynamic table holding those ids:
    alternated, medians. ``kernels``: the ps's table kernels (``PSTRAIN_KERNELS``).
    The fixed table's row numbers come ascending (drawn with ``np.unique``), the dynamic
    table's ids in that order, so not ascending; ``ascending=True`` gives the dynamic
    table its ids ascending too, as a model's ``pstrain.math.unique(sorted=True)`` does."""
    env = {**os.environ, "PSTRAIN_KERNELS": "numpy" if kernels == "numpy" else "compiled"}
    async with pstrain.LocalCluster(num_ps=2, num_workers=1, env=env) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        async with strategy.scope():
            fixed = pstrain.Variable(
                pstrain.initializers.RandomUniform(-0.05, 0.05, seed=0), shape=(rows, DIM), name="cost/fixed"
            )
            dynamic = pstrain.DynamicEmbedding(DIM, name="cost/dynamic")
            opt = pstrain.optimizers.Adagrad(0.05, initial_accumulator_value=0.1)
        rng = np.random.default_rng(0)
        keys = rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64)
        for lo in range(0, rows, 65536):  # every id admitted: the same rows exist in both
            await dynamic.lookup(keys[lo : lo + 65536])
        grad = np.full((batch, DIM), 0.01, np.float32)
        times: dict[str, list[float]] = {"fixed": [], "dynamic": []}
        for i in range(iters):
            idx = np.unique(rng.integers(0, rows, batch * 2))[:batch]
            dyn_ids = np.sort(keys[idx]) if ascending else keys[idx]
            for name, table, ids in (("fixed", fixed, idx), ("dynamic", dynamic, dyn_ids))[
                :: 1 if i % 2 else -1
            ]:
                t = time.perf_counter()
                await pstrain.embedding_lookup(table, ids)
                await opt.apply_gradients([(pstrain.IndexedSlices(grad[: ids.size], ids), table)])
                times[name].append(time.perf_counter() - t)
        fixed_ms, dynamic_ms = (median(times[k]) * 1e3 for k in ("fixed", "dynamic"))
        return {"fixed_ms": fixed_ms, "dynamic_ms": dynamic_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--variants", default="a,b,c")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--w4-steps", type=int, default=1000)
    parser.add_argument(
        "--cost-only", action="store_true", help="only the lookup + update cost, fixed against dynamic"
    )
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw results/W6.png from every run in results/W6.jsonl"
    )
    args = parser.parse_args()
    if args.plot_only:
        plot_all()
        return
    # the reference kernels first, as a peer of the same run; then the compiled ones, with
    # the dynamic ids as drawn and ascending (as the fixed table's are)
    for kernels, ascending in (("numpy", False), ("compiled", False), ("compiled", True)):
        cost = pstrain.run(lookup_update_cost(1_000_000, 4096, 200, kernels, ascending))
        emit(
            {
                "ps": 2,
                "metric": "lookup_update_ms",
                "value": round(cost["dynamic_ms"], 3),
                "fixed_ms": round(cost["fixed_ms"], 3),
                "kernels": kernels,
                "dynamic_ids": "ascending" if ascending else "hash order",
                "ratio_dynamic_to_fixed": round(cost["dynamic_ms"] / cost["fixed_ms"], 3),
                "rows": 1_000_000,
                "batch": 4096,
                "iterations": 200,
                "note": "lookup + Adagrad update of the same unique rows, from the coordinator",
            },
            "W6",
        )
    if args.cost_only:
        return
    results: dict[str, list[dict]] = {}
    w4, w4_bytes, w4_cpu = [], [], []
    jobs = ["W4", *args.variants.split(",")]
    # The first training of a fresh process often runs slower, every process of its cluster
    # taking more CPU a step (W4 in the first rounds of runs 69 and 70: 111,751 and 124,389
    # examples/s, against 142,056-149,666 in their later rounds; not in run 71), and that was
    # always W4's first round: a short W4 training, not kept, takes it on.
    pstrain.run(run_w4(max(100, args.w4_steps // 5), 2, 2))
    for i in range(args.runs):
        # each round in another order (W4 b c, b c W4, c W4 b, ...): none always runs first,
        # or always after the same one, while the machine's speed drifts over minutes
        for job in jobs[i % len(jobs) :] + jobs[: i % len(jobs)]:
            if job == "W4":
                r = pstrain.run(run_w4(args.w4_steps, 2, 2))
                w4.append(r["examples_per_s"])
                w4_bytes.append(r["bytes_per_step"])
                w4_cpu.append(r["cpu_ms_per_step"])
            else:
                results.setdefault(job, []).append(pstrain.run(run_variant(job, args.steps)))
    w4_median = median(w4)
    emit(
        {
            "workers": 2,
            "ps": 2,
            "metric": "examples_per_s",
            "value": round(w4_median, 1),
            "bytes_per_step": round(median(w4_bytes)),
            "cpu_ms_per_step": round(median(w4_cpu), 2),
            "steps": args.w4_steps,
            "batch": BATCH,
            "runs": len(w4),
            "note": "W4 in the W6 run",
            "examples_per_s_each_round": [round(x) for x in w4],
        },
        "W6",
    )
    series = {}
    for variant, runs in results.items():
        best = {
            k: median([r[k] for r in runs])
            for k in ("examples_per_s", "held_out_log_loss", "rows_held", "cpu_ms_per_step", "bytes_per_step")
        }
        last = runs[-1]
        emit(
            {
                "workers": 2,
                "ps": 2,
                "variant": variant,
                "metric": "examples_per_s",
                "value": round(best["examples_per_s"], 1),
                "ratio_to_w4": round(best["examples_per_s"] / w4_median, 3),
                "held_out_log_loss": round(best["held_out_log_loss"], 4),
                "base_rate_log_loss": round(last["base_rate_log_loss"], 4),
                "rows_held": int(best["rows_held"]),
                "peak_rss_mib_per_ps": last["peak_rss_mib_per_ps"],
                "rss_mib_second_half_min_max": last["rss_mib_second_half_min_max"],
                "cpu_ms_per_step": round(best["cpu_ms_per_step"], 2),
                "bytes_per_step": round(best["bytes_per_step"]),
                "steps": args.steps,
                "batch": BATCH,
                "runs": len(runs),
                "worker_data": WORKER_DATA,
                # each round's ratio to W4's of the same round: the spread of the medians' inputs
                "ratio_to_w4_each_round": [round(r["examples_per_s"] / x, 3) for r, x in zip(runs, w4)],
            },
            "W6",
        )
        series[LABELS[variant]] = ([best["rows_held"]], [best["held_out_log_loss"]])
    plot(
        RESULTS / "W6.png",
        "W6: held-out log loss against rows held",
        "rows held",
        "held-out log loss",
        series,
    )
    plot_all()


LABELS = {"a": "(a) dynamic, no limit", "b": "(b) capacity 500k, admit 2, LRU", "c": "(c) fixed 500k, hashed"}


def plot_all() -> None:
    """Held-out loss against rows held, every run of every variant in results/W6.jsonl."""
    import json

    series: dict[str, tuple[list, list]] = {}
    with open(RESULTS / "W6.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "variant" in r:
                xs, ys = series.setdefault(LABELS[r["variant"]], ([], []))
                xs.append(r["rows_held"])
                ys.append(r["held_out_log_loss"])
    plot(
        RESULTS / "W6.png",
        "W6: held-out log loss against rows held (each point a run)",
        "rows held",
        "held-out log loss",
        series,
        logx=True,
        points=True,
    )


if __name__ == "__main__":
    main()
