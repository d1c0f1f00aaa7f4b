"""How many rows a tiered table holds under a byte budget, against the same table wholly in RAM.

For each row width, one shard of a dynamic table trained with Adagrad (a row and its
accumulator), fed batches of ids it has not seen, in one process (no ps: the shard's own
arrays are all its budget covers here). The table wholly in RAM grows until its arrays
pass the budget; the tiered one, its hot set within the budget and the rest on disk
(``--table-dir``), until it refuses a batch (the index of its rows on disk fills what the
budget leaves). The tiered shard is held to what a ps gives its tables: the budget less
the room it keeps for requests in flight (``Tiering.limit``). Each line of
``results/tiered_capacity.jsonl`` gives, per width, the rows each held, their ratio
(``rows_over_in_ram``), the RAM each row on disk takes (its index and bookkeeping) and the
bytes on disk; ``results/tiered_capacity.png`` plots the ratio.

    python benchmarks/tiered_capacity.py [--budget 32MiB] [--dims 8,16,32,64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import RESULTS, emit, plot

from pstrain._base.checks import byte_size
from pstrain._formats.numerics.optimizer_rules import RULES
from pstrain.errors import ResourceExhaustedError
from pstrain.server.ps.tables.dynamic_table import DynamicTable
from pstrain.server.ps.tables.table_config import TableConfig
from pstrain.server.ps.tables.tiered_table import TieredTable, Tiering

ADAGRAD = {"accumulator": ("acc", 0.1)}
CONFIG = {"kind": "adagrad", "learning_rate": 0.05, "epsilon": 1e-7}
BATCH = 8192


def _train(table: DynamicTable, ids: np.ndarray, step: int) -> None:
    if isinstance(table, TieredTable) and table.cold_short(ids.size):
        table.shrink_for_cold(ids.size)  # as a ps does before each request (its stage)
    table.lookup(ids, True)
    grad = np.full((ids.size, table.config.dim), 0.01, np.float32)
    table.apply(RULES["adagrad"], ids, grad, ADAGRAD, CONFIG, step)


def _batches(seed: int):
    rng = np.random.default_rng(seed)
    step = 0
    while True:
        step += 1
        yield step, rng.integers(-(2**62), 2**62, BATCH, dtype=np.int64)


def in_ram_rows(dim: int, budget: int) -> int:
    """Rows an untiered shard holds before its arrays pass ``budget``."""
    table = DynamicTable("t", TableConfig(dim=dim))
    held = 0
    for step, ids in _batches(1):
        _train(table, ids, step)
        if table.nbytes > budget:
            return held
        held = len(table)
    raise AssertionError("unreachable")


def tiered_rows(dim: int, budget: int, directory: str) -> dict[str, float]:
    """Rows a tiered shard holds under ``budget`` before it refuses a batch of new ids."""
    box: list[TieredTable] = []
    tiering = Tiering(budget, directory)  # what a ps under ``budget`` gives its tables
    table = TieredTable(
        "t",
        TableConfig(dim=dim),
        directory=directory,
        budget=tiering.limit,
        ps_budget=budget,
        held=lambda: box[0].nbytes if box else 0,
    )
    box.append(table)
    peak = 0
    for step, ids in _batches(2):
        try:
            _train(table, ids, step)
        except ResourceExhaustedError:
            break
        peak = max(peak, table.nbytes)
    stats = table.statistics()
    return {
        "rows": len(table),
        "rows_in_ram": stats["hot_rows"],
        "rows_on_disk": stats["cold_rows"],
        "ram_bytes_per_row_on_disk": round(table.cold.nbytes / max(1, len(table.cold)), 1),
        "disk_bytes": stats["disk_bytes"],
        "peak_bytes_over_budget": round(peak / budget, 3),
        "hot_set_shrunk": table.shrunk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="32MiB")
    parser.add_argument("--dims", default="8,16,32,64")
    args = parser.parse_args()
    budget = byte_size(args.budget, "--budget")
    dims = [int(d) for d in args.dims.split(",")]
    ratios = []
    for dim in dims:
        ram = in_ram_rows(dim, budget)
        with tempfile.TemporaryDirectory(prefix="pstrain-capacity-") as root:
            tiered = tiered_rows(dim, budget, str(Path(root) / "cold"))
        ratio = tiered["rows"] / ram
        ratios.append(ratio)
        emit(
            {
                "metric": "rows_held_under_budget",
                "dim": dim,
                "optimizer": "adagrad",
                "budget_bytes": budget,
                "in_ram_rows": ram,
                **tiered,
                "rows_over_in_ram": round(ratio, 2),
            },
            "tiered_capacity",
        )
    plot(
        RESULTS / "tiered_capacity.png",
        f"Rows a tiered shard holds under {args.budget}, over the same wholly in RAM",
        "row width (float32, with an Adagrad accumulator)",
        "rows held / rows held in RAM",
        {"tiered": (dims, ratios)},
        logx=True,
        hline=("in RAM", 1.0),
    )


if __name__ == "__main__":
    main()
