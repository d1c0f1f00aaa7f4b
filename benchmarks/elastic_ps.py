"""Elastic ps: what moving variables between ps costs, against a plain copy of the same bytes.

A real cluster (3 ps, 2 workers, W4's model: its 1,000,000 x 16 table in two shards with
Adagrad). In one run:

* **bulk** (no training): a 1 GiB variable moves ps 0 -> ps 1 -> ps 0 (``coordinator.ps.move``:
  copy, catch up, switch), against a plain copy of the same bytes by the same route
  (``read_value`` from ps 0 to the coordinator, ``assign`` to a variable on ps 1) and raw
  loopback TCP between two processes (the machine's limit), medians of ``--repeats``;
* **W4 during a move**: W4 trains throughout; its examples/s in windows *before* (nothing
  else runs), *during moves* of its own hot table shard with its accumulator (ps 0 -> ps 2
  and back, again and again), and *during plain copies* of the same bytes (that shard and
  accumulator read and assigned to spare variables on ps 2), in turns, ``--rounds`` times.

    python benchmarks/elastic_ps.py [--repeats 3] [--rounds 3] [--window 4]

Writes ``results/elastic_ps.jsonl`` and ``results/elastic_ps.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
from common import RESULTS, emit, median, raw_tcp_mib_s, save_figure

import pstrain
from pstrain._formats.messages.operations import ReadVariables
from pstrain.ctr import BATCH, CTRModel, make_step, synthetic

BIG_ROWS, BIG_DIM, BIG_PARTS = 1 << 21, 64, 2  # 1 GiB of float32, in two 512 MiB variables
# (a ps takes at most 512 MiB per variable by default: --max-variable-bytes)


async def _bulk(coordinator, big, spare, repeats: int) -> dict:
    moves, copies = [], []
    for v in big + spare:  # a ps fills an initializer's value on first use: not timed
        await v.read_value()
    for k in range(repeats + 1):  # the first round warms up, untimed
        for to in (1, 0):
            t = time.perf_counter()
            await coordinator.ps.move([b.key for b in big], to)
            if k:
                moves.append(time.perf_counter() - t)
        t = time.perf_counter()
        for b, s in zip(big, spare):
            await s.assign(await b.read_value())
        if k:
            copies.append(time.perf_counter() - t)
    nbytes = sum(b.shape[0] * b.shape[1] * 4 for b in big)
    return {
        "bytes": nbytes,
        "move_s": median(moves),
        "copy_s": median(copies),
        "move_gb_s": nbytes / median(moves) / 1e9,
        "copy_gb_s": nbytes / median(copies) / 1e9,
    }


async def _trained(coordinator, step, iterator, done_at: list[float], stop: asyncio.Event) -> None:
    """W4 steps, scheduled ahead, until ``stop``; each finish time goes in ``done_at``."""
    pending: list = []
    while not stop.is_set():
        while len(pending) < 16:
            pending.append(coordinator.schedule(step, args=(iterator,)))
        await pending.pop(0)
        done_at.append(time.perf_counter())
    for rv in pending:
        await rv


def _rate(done_at: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in done_at) * BATCH / (end - start)


async def run(repeats: int, rounds: int, window: float) -> None:
    async with pstrain.LocalCluster(num_ps=3, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():  # W4's model, as examples/ctr_embedding.py builds it
            model = CTRModel()
            opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
        step = make_step(model, opt)
        async with strategy.scope():
            big, spare = [], []
            for k in range(BIG_PARTS):
                with strategy.placement.colocated(0):
                    big.append(
                        pstrain.Variable(
                            pstrain.initializers.Ones(),
                            shape=(BIG_ROWS, BIG_DIM),
                            dtype=np.float32,
                            name=f"big{k}",
                        )
                    )
                with strategy.placement.colocated(1):
                    spare.append(
                        pstrain.Variable(
                            pstrain.initializers.Ones(),
                            shape=(BIG_ROWS, BIG_DIM),
                            dtype=np.float32,
                            name=f"spare{k}",
                        )
                    )
        limit = raw_tcp_mib_s(64 << 20) * (1 << 20) / 1e9
        bulk = await _bulk(coordinator, big, spare, repeats)
        emit(
            {
                "metric": "move_1gib",
                **{k: round(v, 3) for k, v in bulk.items()},
                "raw_tcp_gb_s": round(limit, 3),
                "repeats": repeats,
            },
            "elastic_ps",
        )
        part = model.table.variables[0]  # W4's hot table shard
        table, home = part.key, part.ps_index
        slot = opt.slot_variable_name(part, "accumulator")
        async with strategy.scope():
            with strategy.placement.colocated(2):
                spare_rows = pstrain.Variable(np.zeros(part.shape, np.float32), name="spare_rows")
                spare_slot = pstrain.Variable(np.zeros(part.shape, np.float32), name="spare_slot")

        def dataset_fn():
            (ids, dense_x, y), _ = synthetic(200 * BATCH, 0)
            return pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y)).repeat().batch(BATCH)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        done_at: list[float] = []
        stop = asyncio.Event()
        trainer = asyncio.ensure_future(_trained(coordinator, step, iterator, done_at, stop))
        while len(done_at) < 100:  # warm-up
            await asyncio.sleep(0.05)
        rates: dict[str, list[float]] = {"before": [], "during_move": [], "during_copy": []}
        moved_bytes, move_times = 0, []
        for _ in range(rounds):
            start = time.perf_counter()
            await asyncio.sleep(window)  # training alone
            rates["before"].append(_rate(done_at, start, time.perf_counter()))
            start = time.perf_counter()
            while time.perf_counter() - start < window:
                for to in (2, home):
                    t = time.perf_counter()
                    before = coordinator.ps.bytes_moved
                    await coordinator.ps.move([table], to)
                    move_times.append(time.perf_counter() - t)
                    moved_bytes = coordinator.ps.bytes_moved - before
            rates["during_move"].append(_rate(done_at, start, time.perf_counter()))
            start = time.perf_counter()
            channel = part.channel()
            while time.perf_counter() - start < window:
                for _ in range(2):
                    values = (await channel.request(ReadVariables(names=[table, slot]))).values
                    await spare_rows.assign(values[0])
                    await spare_slot.assign(values[1])
            rates["during_copy"].append(_rate(done_at, start, time.perf_counter()))
        stop.set()
        await trainer
        row = {
            "metric": "w4_examples_per_s",
            "window_s": window,
            "rounds": rounds,
            **{k: round(median(v), 1) for k, v in rates.items()},
            "move_vs_before": round(median(rates["during_move"]) / median(rates["before"]), 3),
            "copy_vs_before": round(median(rates["during_copy"]) / median(rates["before"]), 3),
            "moved_bytes_each": moved_bytes,
            "move_s": round(median(move_times), 3),
            "all": {k: [round(x) for x in v] for k, v in rates.items()},
        }
        emit(row, "elastic_ps")
        _plot(bulk, limit, row)
        await coordinator.close()


def _plot(bulk: dict, limit: float, w4: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    a.bar(
        ["move (copy,\ncatch up, switch)", "plain copy\n(read + assign)", "raw TCP\n(limit)"],
        [bulk["move_gb_s"], bulk["copy_gb_s"], limit],
        color=["C0", "C1", "grey"],
    )
    a.set_ylabel("GB/s")
    a.set_title(f"1 GiB between two ps: move {bulk['move_s']:.2f} s, copy {bulk['copy_s']:.2f} s")
    b.bar(
        ["before", "during moves\nof its table shard", "during plain copies\nof the same bytes"],
        [w4["before"], w4["during_move"], w4["during_copy"]],
        color=["grey", "C0", "C1"],
    )
    b.set_ylabel("examples/s")
    b.set_title("W4 (2 workers) while its table moves")
    save_figure(fig, RESULTS / "elastic_ps.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=4.0)
    args = parser.parse_args()
    pstrain.run(run(args.repeats, args.rounds, args.window))


if __name__ == "__main__":
    main()
