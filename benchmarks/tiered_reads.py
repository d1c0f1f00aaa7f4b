"""A tiered shard's rows read back from disk when the disk part is not in the page cache:
the reads through io_uring against the same reads by ``pread``, one at a time.

A table ten times a ps's memory has its disk part mostly out of the page cache too (the
machine's memory is the ps's and the other processes'). ``tiered_path.py`` measures a
tiered shard's steps with every segment cached (the fill has just written them); this
runs the same steps (``tiered_path.step``: W4's Zipf ids, half of a 512-example batch a
step, the rows on disk it names read back, colder rows moved out, the lookup and its
Adagrad update) with the shard's segment files dropped from the page cache before each
step (``posix_fadvise(DONTNEED)``, on this benchmark's own files; not timed), so every row
read back is read from the disk. Each size runs three ways, alternated, the order turning
each round: in RAM, tiered with its reads through io_uring (the default), tiered with them
by ``pread`` (what ``PSTRAIN_IO_URING=0`` chooses). Reported, medians of ``--rounds``: the
CPU per row read back beyond the in-RAM steps (``us_cpu_per_row``), and the wall time of
the tiered steps (``ms_wall_per_step``). Results in ``results/tiered_reads.jsonl`` and
``results/tiered_reads.png``.

    python benchmarks/tiered_reads.py [--rows 1000000,4000000] [--rounds 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import tiered_path
from common import RESULTS, emit, median, plot

from pstrain._kernels import compiled

WAYS = ("in_ram", "io_uring", "pread")


def drop_cached(directory: str) -> None:
    """Drop the page cache of every file under ``directory`` (a shard's segments)."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one(rows: int, way: str) -> dict[str, float]:
    """CPU and wall time of ``--steps`` steps after ``--warm``, the page cache of the shard's
    segments dropped before each (outside the clocks)."""
    was = compiled._URING
    compiled._URING = way != "pread"  # read at each call: this process's reads, this run
    try:
        with tempfile.TemporaryDirectory(prefix="pstrain-tiered-reads-") as root:
            table = tiered_path.shard(rows, None if way == "in_ram" else f"{root}/cold")
            ids = tiered_path.batches(rows, args.warm + args.steps)
            for t, batch in enumerate(ids[: args.warm], 2):
                tiered_path.step(table, batch, t)
            before = getattr(table, "promoted", 0)
            cpu = wall = 0.0
            for t, batch in enumerate(ids[args.warm :], 2 + args.warm):
                if way != "in_ram":
                    drop_cached(root)
                c0, w0 = time.process_time(), time.perf_counter()
                tiered_path.step(table, batch, t)
                cpu += time.process_time() - c0
                wall += time.perf_counter() - w0
            return {
                "ms_cpu_per_step": cpu * 1e3 / args.steps,
                "ms_wall_per_step": wall * 1e3 / args.steps,
                "read_back_per_step": (getattr(table, "promoted", 0) - before) / args.steps,
            }
    finally:
        compiled._URING = was


def run() -> None:
    sizes = [int(x) for x in args.rows.split(",")]
    series: dict[str, tuple[list[float], list[float]]] = {"io_uring": ([], []), "pread": ([], [])}
    for rows in sizes:
        got: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
        for k in range(args.rounds):
            order = WAYS[k % 3 :] + WAYS[: k % 3]
            for way in order:
                got[way].append(one(rows, way))
        record: dict[str, Any] = {
            "metric": "tiered_reads",
            "rows": rows,
            "budget_bytes": int(rows * tiered_path.BUDGET_PER_ROW),
            "page_cache": "dropped before each step",
            "io_uring_used": compiled.io_uring_reads(),
            "in_ram_ms_cpu_per_step": round(median([g["ms_cpu_per_step"] for g in got["in_ram"]]), 2),
        }
        for way in ("io_uring", "pread"):
            per_row = [
                (t["ms_cpu_per_step"] - r["ms_cpu_per_step"]) * 1e3 / t["read_back_per_step"]
                for t, r in zip(got[way], got["in_ram"])
            ]
            record[f"{way}_read_back_per_step"] = round(median([g["read_back_per_step"] for g in got[way]]))
            record[f"{way}_us_cpu_per_row"] = round(median(per_row), 2)
            record[f"{way}_us_cpu_per_row_each_round"] = [round(x, 2) for x in per_row]
            record[f"{way}_ms_wall_per_step"] = round(median([g["ms_wall_per_step"] for g in got[way]]), 2)
            series[way][0].append(rows / 1e6)
            series[way][1].append(record[f"{way}_us_cpu_per_row"])
        record["pread_over_io_uring_cpu"] = round(
            record["pread_us_cpu_per_row"] / record["io_uring_us_cpu_per_row"], 2
        )
        record["pread_over_io_uring_wall"] = round(
            record["pread_ms_wall_per_step"] / record["io_uring_ms_wall_per_step"], 2
        )
        record.update({"rounds": args.rounds, "steps": args.steps})
        emit(record, "tiered_reads")
    plot(
        RESULTS / "tiered_reads.png",
        "A tiered shard's CPU per row read back, its segments out of the page cache",
        "rows in the shard (millions), at W9's budget per row",
        "µs of CPU per row read back (beyond the steps in RAM)",
        {f"reads by {way}": xy for way, xy in series.items()},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,4000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warm", type=int, default=50)
    args = parser.parse_args()
    run()
