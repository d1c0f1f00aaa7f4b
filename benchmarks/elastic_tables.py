"""Elastic ps with a dynamic table: moving slices of its hash space between ps, against a
plain copy of the same bytes.

A real cluster (2 ps, 1 worker). A DynamicEmbedding 64 wide (float32) trained with
Adagrad holds 4,194,304 rows, half on each ps: each ps's half is 1 GiB of rows and
accumulators. Timed in one run, medians of ``--repeats`` after an untimed round:

* **move**: every slice ps 0 holds goes to ps 1, then back (``coordinator.ps.move_slices``:
  copy, catch up, switch; the rows' LRU/LFU state and sightings travel too);
* **plain copy** of the same bytes by the same route: two 512 MiB variables read from ps 0
  by the coordinator and assigned to two variables on ps 1;
* **raw loopback TCP** between two processes (the machine's limit).

With ``--tiered BUDGET`` the ps keep the table within ``--memory-budget BUDGET`` (the rest on
disk, ``--rows`` rows in all): the move is timed on those ps, and the plain copy of as many
bytes (two variables of the moved rows' shape) on a second pair of ps without a budget,
started beside them and alternated with the moves (variables would count in the budget).
Each tiered ps's RSS is sampled every 100 ms while they run: ``peak_rss_over_budget`` is the
largest peak over the RSS a ps had before it held anything, against the budget.

    python benchmarks/elastic_tables.py [--repeats 3] [--tiered 64MiB --rows 1048576]

Writes ``results/elastic_tables.jsonl`` and ``results/elastic_tables.png`` (the tiered run:
``elastic_tables_tiered.png``).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from common import RESULTS, emit, median, raw_tcp_mib_s, save_figure
from dynamic_tables import peak_rss, rss_mib

import pstrain
from pstrain._base.checks import byte_size
from pstrain._formats.messages.operations import TableStatistics

DIM, ROWS, BATCH = 64, 1 << 22, 1 << 16  # 4M rows: 1 GiB of rows and accumulators per ps
COPY_ROWS = 1 << 21  # two variables of COPY_ROWS x DIM float32: 512 MiB each


async def _fill(table, opt, rows: int = ROWS) -> None:
    """Every row admitted, and trained once (its accumulator made)."""
    ids_all = np.arange(rows, dtype=np.int64) * 0x9E3779B1 + 12345
    for start in range(0, rows, BATCH):
        ids = ids_all[start : start + BATCH]
        await table.lookup(ids)
        grads = np.full((ids.size, DIM), 0.01, np.float32)
        await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])


async def _alternate(coordinator, table, slices, src, dst, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each move of ``slices`` from ps 0 to ps 1 and back, and of each plain copy
    of variables ``src`` into ``dst``, alternated: ``repeats`` rounds after an untimed one."""
    moves, copies = [], []
    for k in range(repeats + 1):
        for a, b in ((0, 1), (1, 0)):
            t = time.perf_counter()
            await coordinator.ps.move_slices({table.key: slices}, a, b)
            if k:
                moves.append(time.perf_counter() - t)
        t = time.perf_counter()
        for s, d in zip(src, dst):
            await d.assign(await s.read_value())
        if k:
            copies.append(time.perf_counter() - t)
    return moves, copies


def _copy_variables(strategy, rows: int) -> tuple[list, list]:
    """Two variables of ``rows`` x DIM float32 on ps 0 and two on ps 1 (made in ``strategy``'s
    scope): what a plain copy reads and assigns."""
    made: dict[int, list] = {0: [], 1: []}
    for k in range(2):
        for ps, name in ((0, "src"), (1, "dst")):
            with strategy.placement.colocated(ps):
                made[ps].append(
                    pstrain.Variable(
                        pstrain.initializers.Ones(), shape=(rows, DIM), dtype=np.float32, name=f"{name}{k}"
                    )
                )
    return made[0], made[1]


def _figures(rows: int, slices: list[int], moves: list[float], copy_bytes: int, copies: list[float]) -> dict:
    """A move of ``rows`` rows with their accumulators (``slices``) against a plain copy of
    ``copy_bytes``: medians, rates, their ratio, and the machine's loopback limit."""
    nbytes = rows * DIM * 4 * 2
    return {
        "rows": rows,
        "bytes": nbytes,
        "slices": len(slices),
        "move_s": round(median(moves), 3),
        "copy_bytes": copy_bytes,
        "copy_s": round(median(copies), 3),
        "move_gb_s": round(nbytes / median(moves) / 1e9, 3),
        "copy_gb_s": round(copy_bytes / median(copies) / 1e9, 3),
        "move_over_copy": round((nbytes / median(moves)) / (copy_bytes / median(copies)), 3),
        "raw_tcp_gb_s": round(raw_tcp_mib_s(64 << 20) * (1 << 20) / 1e9, 3),
        "all_moves_s": [round(x, 3) for x in moves],
        "all_copies_s": [round(x, 3) for x in copies],
    }


async def run(repeats: int) -> None:
    limit_args = ["--max-variable-bytes", str(4 << 30)]
    async with pstrain.LocalCluster(num_ps=2, num_workers=1, extra_args=limit_args) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="items")
            opt = pstrain.optimizers.Adagrad(0.05)
            src, dst = _copy_variables(strategy, COPY_ROWS)
        t = time.perf_counter()
        await _fill(table, opt)
        fill_s = time.perf_counter() - t
        for v in src + dst:
            await v.read_value()
        first = coordinator.ps.table_slices(table).held_by(0)
        rows_on_0 = int((await table.channel(0).request(TableStatistics(name=table.key)))["rows"])
        moves, copies = await _alternate(coordinator, table, first, src, dst, repeats)
        rows_back = int((await table.channel(0).request(TableStatistics(name=table.key)))["rows"])
        assert rows_back == rows_on_0, (rows_back, rows_on_0)
        row = {"metric": "table_move", **_figures(rows_on_0, first, moves, 2 * COPY_ROWS * DIM * 4, copies)}
        row.update(repeats=repeats, fill_s=round(fill_s, 1))
        emit(row, "elastic_tables")
        _plot(row)
        await coordinator.close()


async def run_tiered(repeats: int, rows: int, budget: str) -> None:
    """A tiered table's slices moved between two ps, against a plain copy of as many bytes
    between two other ps (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="pstrain-elastic-tier-") as tier:
        async with (
            pstrain.LocalCluster(num_ps=2, num_workers=1, memory_budget=budget, table_dir=tier) as cluster,
            pstrain.LocalCluster(
                num_ps=2, num_workers=1, extra_args=["--max-variable-bytes", str(4 << 30)]
            ) as plain,
        ):
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            coordinator = pstrain.ClusterCoordinator(strategy)
            async with strategy.scope():
                table = pstrain.DynamicEmbedding(DIM, name="items")
                opt = pstrain.optimizers.Adagrad(0.05)
            ps_pids = [cluster.pid("ps", k) for k in range(2)]
            at_start = [rss_mib(p) for p in ps_pids]  # each ps before it holds anything
            t = time.perf_counter()
            await _fill(table, opt, rows)
            fill_s = time.perf_counter() - t
            first = coordinator.ps.table_slices(table).held_by(0)
            stats = await table.channel(0).request(TableStatistics(name=table.key))
            rows_on_0 = int(stats["rows"])
            copy_strategy = pstrain.ParameterServerStrategy(plain.resolver)
            async with copy_strategy.scope():  # the moved rows and their accumulators: as many bytes
                src, dst = _copy_variables(copy_strategy, rows_on_0)
            for v in src + dst:
                await v.read_value()
            with peak_rss(ps_pids) as peaks:  # each tiered ps's RSS every 100 ms while the moves run
                moves, copies = await _alternate(coordinator, table, first, src, dst, repeats)
            back = await table.channel(0).request(TableStatistics(name=table.key))
            assert int(back["rows"]) == rows_on_0, (back["rows"], rows_on_0)
            nbytes = rows_on_0 * DIM * 4 * 2
            row = {
                "metric": "tiered_table_move",
                "budget": budget,
                "rows_on_disk": int(stats["cold_rows"]),
                **_figures(rows_on_0, first, moves, nbytes, copies),
                # each ps's RSS during the moves over what it had before holding anything,
                # against its budget (the goal: at most 1.15)
                "peak_rss_over_budget": round(
                    max(peak - start for peak, start in zip(peaks, at_start))
                    / (byte_size(budget, "--tiered") / 2**20),
                    3,
                ),
                "peak_rss_mib_per_ps": [round(x) for x in peaks],
                "rss_mib_at_start_per_ps": [round(x) for x in at_start],
            }
            row.update(repeats=repeats, fill_s=round(fill_s, 1))
            emit(row, "elastic_tables")
            _plot(row, "elastic_tables_tiered.png")
            await coordinator.close()


def _plot(row: dict, name: str = "elastic_tables.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=110)
    ax.bar(
        ["move of table slices\n(copy, catch up, switch)", "plain copy\n(read + assign)", "raw TCP\n(limit)"],
        [row["move_gb_s"], row["copy_gb_s"], row["raw_tcp_gb_s"]],
        color=["C0", "C1", "grey"],
    )
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"{row['bytes'] / 2**30:.2f} GiB of a table's rows and slots between two ps:\n"
        f"move {row['move_s']:.2f} s, plain copy of {row['copy_bytes'] / 2**30:.2f} GiB {row['copy_s']:.2f} s"
    )
    save_figure(fig, RESULTS / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiered", metavar="BUDGET", help="each ps's --memory-budget (a tiered table)")
    parser.add_argument("--rows", type=int, default=ROWS, help="the table's rows with --tiered")
    args = parser.parse_args()
    pstrain.run(run_tiered(args.repeats, args.rows, args.tiered) if args.tiered else run(args.repeats))


if __name__ == "__main__":
    main()
