"""The CPU a tiered table spends for each row it reads back from disk, in one thread.

W9 (``tiered_tables.py --table w7``) runs two ps, two workers and a coordinator on two cores,
and its examples/s move by a third from run to run on this machine. This runs one shard's
side of W9's training steps in one process and one thread, on the ps's own table code, and
times it by the CPU it takes: what a ps does for a training lookup and its Adagrad update
(the rows the request names that are on disk read back into RAM, colder rows moved out to
make room, the lookup, the update), on a shard holding every row of its share of the table,
against the same steps on a shard that holds it all in RAM. The difference over the rows
read back is the cost of one (``us_per_row_read_back``); W9's goal of 0.7x the in-RAM run's
examples/s leaves 2.8 µs for it on this machine (``docs/benchmarks.md``).

The sweep is the table's size at W9's budget per row (512 MiB for 12.5 million rows), W4's
Zipf ids, half of a 512-example batch's a step (a shard's share). Medians of ``--rounds``,
in-RAM and tiered alternated; results in ``results/tiered_path.jsonl`` and
``results/tiered_path.png``.

    python benchmarks/tiered_path.py [--rows 1000000,4000000,12500000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np
from common import RESULTS, emit, median, plot

from pstrain._formats.numerics.optimizer_rules import RULES
from pstrain.server.ps.tables.dynamic_table import DynamicTable
from pstrain.server.ps.tables.table_config import TableConfig
from pstrain.server.ps.tables.tiered_table import TieredTable

DIM, FEATURES, EXAMPLES = 32, 26, 512
#: W9's budget per row of a shard: 512 MiB for 12.5 million.
BUDGET_PER_ROW = (512 << 20) / 12_500_000
ADAGRAD = {"accumulator": ("acc", 0.1)}
CONFIG = {"kind": "adagrad", "learning_rate": 0.05, "epsilon": 1e-7}
FILL = 8192


def batches(rows: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` steps' distinct ids of one shard of ``rows``: W4's hashed Zipf ids of a
    512-example batch, the half of them a shard of two gets."""
    rng = np.random.default_rng(seed)
    f = np.arange(1, FEATURES + 1, dtype=np.uint64)
    out = []
    for _ in range(n):
        raw = rng.zipf(1.2, (EXAMPLES, FEATURES)).astype(np.uint64)
        with np.errstate(over="ignore"):
            h = raw * np.uint64(0x9E3779B97F4A7C15) + f * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
        ids = (h % np.uint64(2 * rows)).astype(np.int64).reshape(-1)
        out.append(np.unique(ids[ids % 2 == 0] // 2))
    return out


def step(table: DynamicTable, ids: np.ndarray, t: int) -> None:
    """What a ps does for a training lookup of ``ids`` and its update (``TableHandlers.stage``
    first on a tiered shard: the rows on disk it names read back, here inline)."""
    if isinstance(table, TieredTable):
        if table.cold_short(ids.size):
            table.shrink_for_cold(ids.size, keep=ids)
        found = table.in_ram(ids)
        cold_ids, slots, places = table.cold_found(ids[found.pos < 0])
        if cold_ids.size:
            table.cold.begin_read()
            try:
                records = table.read_cold(places, cold_ids, table.cold.made_at(slots))
            finally:
                table.cold.end_read()
            table.promote(cold_ids, slots, places, records, ids, found)
    table.lookup(ids, True)
    table.apply(RULES["adagrad"], ids, np.full((ids.size, DIM), 0.01, np.float32), ADAGRAD, CONFIG, t)


def shard(rows: int, directory: str | None) -> DynamicTable:
    """A shard of ``rows`` rows, each made with its Adagrad slot: tiered under W9's budget
    per row (``directory``), else wholly in RAM."""
    config = TableConfig(dim=DIM)
    if directory is None:
        table: DynamicTable = DynamicTable("t", config)
    else:
        box: list[TieredTable] = []
        table = TieredTable(
            "t",
            config,
            directory=directory,
            budget=int(rows * BUDGET_PER_ROW),
            held=lambda: box[0].nbytes if box else 0,
            cold_index=lambda: box[0].cold.nbytes if box else 0,
        )
        box.append(table)
    zero = np.zeros((FILL, DIM), np.float32)
    for lo in range(0, rows, FILL):
        ids = np.arange(lo, min(rows, lo + FILL), dtype=np.int64)
        if isinstance(table, TieredTable) and table.cold_short(ids.size):
            table.shrink_for_cold(ids.size, keep=ids)
        table.lookup(ids, True)
        table.apply(RULES["adagrad"], ids, zero[: ids.size], ADAGRAD, CONFIG, 1)
    return table


def one(rows: int, tiered: bool) -> dict[str, float]:
    """CPU ms per step over ``--steps`` steps after ``--warm`` (and rows read back per step)."""
    with tempfile.TemporaryDirectory(prefix="pstrain-tiered-path-") as root:
        table = shard(rows, f"{root}/cold" if tiered else None)
        ids = batches(rows, args.warm + args.steps)
        for t, batch in enumerate(ids[: args.warm], 2):
            step(table, batch, t)
        before = getattr(table, "promoted", 0)
        started = time.process_time()
        for t, batch in enumerate(ids[args.warm :], 2 + args.warm):
            step(table, batch, t)
        cpu = time.process_time() - started
        return {
            "ms_per_step": cpu * 1e3 / args.steps,
            "read_back_per_step": (getattr(table, "promoted", 0) - before) / args.steps,
            "ids_per_step": float(np.mean([b.size for b in ids[args.warm :]])),
        }


def run() -> None:
    sizes = [int(x) for x in args.rows.split(",")]
    xs, ys = [], []
    for rows in sizes:
        got: dict[str, list[dict[str, float]]] = {"in_ram": [], "tiered": []}
        for k in range(args.rounds):  # alternated, the order turning each round
            for kind in ("in_ram", "tiered") if k % 2 == 0 else ("tiered", "in_ram"):
                got[kind].append(one(rows, kind == "tiered"))
        per_row = [
            (t["ms_per_step"] - r["ms_per_step"]) * 1e3 / t["read_back_per_step"]
            for t, r in zip(got["tiered"], got["in_ram"])
        ]
        record: dict[str, Any] = {
            "metric": "tiered_path",
            "rows": rows,
            "budget_bytes": int(rows * BUDGET_PER_ROW),
            "ids_per_step": round(median([g["ids_per_step"] for g in got["tiered"]])),
            "read_back_per_step": round(median([g["read_back_per_step"] for g in got["tiered"]])),
            "tiered_ms_per_step": round(median([g["ms_per_step"] for g in got["tiered"]]), 2),
            "in_ram_ms_per_step": round(median([g["ms_per_step"] for g in got["in_ram"]]), 2),
            "us_per_row_read_back": round(median(per_row), 2),
            "us_per_row_read_back_each_round": [round(x, 2) for x in per_row],
            "rounds": args.rounds,
            "steps": args.steps,
        }
        emit(record, "tiered_path")
        xs.append(rows / 1e6)
        ys.append(record["us_per_row_read_back"])
    plot(
        RESULTS / "tiered_path.png",
        "A tiered shard's CPU for each row read back from disk (one thread)",
        "rows in the shard (millions), at W9's budget per row",
        "µs of CPU per row read back",
        {"tiered, less the same steps in RAM": (xs, ys)},
        hline=("what W9's 0.7x of the in-RAM run leaves", 2.8),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,4000000,12500000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm", type=int, default=100)
    args = parser.parse_args()
    run()
