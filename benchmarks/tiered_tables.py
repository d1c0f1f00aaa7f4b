"""W9 in its dynamic-table form: a table larger than its ps's memory budget, against the same
training with the table wholly in RAM, alternated in one run.

WORKLOADS.md's W9 is W7's fixed 25,000,000-row table; pstrain tiers dynamic tables only so
far (a fixed table stays in RAM), so this runs W6's training (W4's model, a
``DynamicEmbedding`` keyed by W6's Zipf ids over the 64-bit space, Adagrad, 2 ps and 2
workers) on ps started with ``--memory-budget`` and ``--table-dir``, and the same on ps
without. Reported (medians): examples per second and ``ratio_to_in_ram``, and the CPU of
all five processes a timed step in each half (``cpu_ms_per_step``,
``in_ram_cpu_ms_per_step``); each ps's RSS sampled every 100 ms, its peak over the RSS it
had before holding anything (``peak_rss_over_budget``: that peak / the budget;
``saves_peak_rss_over_budget`` and ``restore_peak_rss_over_budget``: the same during the
full saves and the restore); rows in RAM and on disk; the hit rate of lookups and the rows
brought back to RAM per step (those made again, as the table made them, and those read from
disk), over the timed steps (a fill's and the warm-up's left out); reads from disk and
their p50/p99 latency; full saves of the table with its Adagrad accumulators (the table and
the optimizer in the checkpoint), each against a plain sequential write of as many bytes to
the same disk, alternated (``save_over_plain_write``: the median of three after the first;
the first, which pays for what the ps and the coordinator set up once, is
``first_save_over_plain_write``); a restore of a base and ten deltas against a plain read
of their files after it, both from disk and each after a read of the same files
(``first_plain_read_s``, not compared: memory this VM has not used lately costs 3 to 8 ms a
MB at first touch, and the one that reads first pays it) (``restore_over_plain_read``), and
the hit rate of the ten steps after it (``hit_rate_after_restore``: the hot set the restore
chose); then a full save of the restored table, which links the base's files its tier still
reads rather than write their rows again (``save_after_restore_bytes``: what it wrote,
links left out; ``save_after_restore_over_plain_write``: a plain write of a full save's
bytes, the median of those above, over its time); held-out log loss of both.

    python benchmarks/tiered_tables.py [--steps 1200] [--budget 80MiB] [--runs 3] [--inflight 2]
        [--eviction lru|lfu]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

import pstrain
from pstrain._base.checks import byte_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, median  # noqa: E402
from dynamic_tables import W7_DIM, W7_ROWS, WORKER_DATA, peak_rss, run_variant  # noqa: E402


async def table_figures(
    model: Any, opt: Any, cluster: pstrain.LocalCluster, train_more: Callable[[int], Awaitable[None]]
) -> dict:
    """The tiers of the table, summed and on each ps (its latencies are per ps); its saves
    (``SAVES`` after the first, one for W7's table: 6.4 GB each); a restore of a base and
    ``DELTAS`` deltas."""
    saves = 1 if model.dim == W7_DIM else SAVES
    table = await model.table.statistics()  # as training left it
    per_ps = []
    for k in range(2):
        address = cluster.cluster_spec.task_address("ps", k)
        channel = pstrain.rpc.Channel(address, token=cluster.token, task=f"/job:ps/replica:0/task:{k}")
        try:
            per_ps.append((await channel.statistics()).get("tables", {}).get(model.table.key, {}))
        finally:
            await channel.close()
    # full saves of the table (both tiers), each against a plain sequential write of as many
    # bytes to the same disk, one after the other: the first (which pays for what a ps and
    # the coordinator set up once) and the median of the next SAVES
    ratios, plains = [], []
    # each ps's largest RSS while the saves run, every 100 ms (as in training)
    with peak_rss([cluster.pid("ps", k) for k in range(2)]) as during:
        for _ in range(1 + saves):
            target = Path(cluster.checkpoint_root) / f"save-{os.getpid()}-{time.monotonic_ns()}"
            started = time.perf_counter()
            path = await pstrain.Checkpoint(table=model.table, optimizer=opt).save(str(target))
            save_s = time.perf_counter() - started
            written = sum(f.stat().st_size for f in Path(path).parent.glob(Path(path).name + "*"))
            plain = plain_write_s(Path(cluster.checkpoint_root) / "plain.bin", written)
            for f in Path(path).parent.glob(Path(path).name + "*"):
                f.unlink()
            ratios.append(plain / save_s)
            plains.append(plain)
    out = {
        "rss_mib_during_saves_max_per_ps": [round(x) for x in during],
        "table": table,
        # (after the figures of training; not for W7's table wholly in RAM: a restore holds
        # the table twice until it commits, more than this machine's RAM)
        **(
            await chain_restore(model, opt, cluster, train_more)
            if model.dim != W7_DIM or cluster.memory_budget is not None
            else {"restore_over_plain_read": None, "hit_rate_after_restore": None, "chain_bytes": None}
        ),
        "table_per_ps": per_ps,
        "save_bytes": written,
        "first_save_over_plain_write": ratios[0],
        "save_over_plain_write": median(ratios[1:]),
        "save_s": save_s,
        "plain_write_s": plain,
    }
    if out.get("save_after_restore_s"):
        out["save_after_restore_over_plain_write"] = median(plains) / out["save_after_restore_s"]
    return out


async def chain_restore(
    model: Any, opt: Any, cluster: pstrain.LocalCluster, train_more: Callable[[int], Awaitable[None]]
) -> dict:
    """A base and ``DELTAS`` deltas, ``DELTA_STEPS`` steps apart, then the table restored
    from the last delta (the base and every delta read and applied on each ps, the base's
    files linked into each tier past the rows its budget keeps in RAM), against a plain
    sequential read of the same files after it. Both read them from disk, as a ps replacing
    a lost one does: the files' pages are dropped from the page cache before each (a restore
    lets them go as it reads, so a read after it found them on disk while the restore had
    found them in RAM); and each just after another read of them (the first, timed as
    ``first_plain_read_s`` but not compared: see the module docstring)."""
    directory = Path(cluster.checkpoint_root) / f"chain-{os.getpid()}-{time.monotonic_ns()}"
    directory.mkdir()
    manager = pstrain.CheckpointManager(
        pstrain.Checkpoint(table=model.table, optimizer=opt), str(directory), max_to_keep=None
    )
    await manager.save()
    last = ""
    for _ in range(DELTAS):
        await train_more(DELTA_STEPS)
        last = await manager.save_delta()
    await manager.close()
    files = [f for f in directory.iterdir() if f.is_file()]
    nbytes = sum(f.stat().st_size for f in files)
    # a first read of the files, not the one measured: on this VM memory not used lately
    # costs 3 to 8 ms a MB at first touch (its free pages go back to the host), whoever
    # touches it; a read just before leaves as much of it warm for the restore as the
    # restore leaves for the plain read after it
    uncache(files)
    cold_read = plain_read_s(files)
    uncache(files)
    # each ps's largest RSS while it restores in place (every 100 ms, as in training): the
    # shard it replaces is set aside on disk where both do not fit the budget
    with peak_rss([cluster.pid("ps", k) for k in range(2)]) as during:
        started = time.perf_counter()
        await pstrain.Checkpoint(table=model.table, optimizer=opt).restore(last)
        restore_s = time.perf_counter() - started
    uncache(files)
    plain = plain_read_s(files)
    shutil.rmtree(directory)
    # the hot set the restore chose: the hit rate of the steps just after it
    before = await model.table.statistics()
    await train_more(AFTER_RESTORE_STEPS)
    after = await model.table.statistics()
    looked = after.get("looked_up", 0) - before.get("looked_up", 0)
    promoted = after.get("promoted", 0) - before.get("promoted", 0)
    # a full save of the restored table: it links the base's files the tier still reads
    # rather than write their rows again (the bytes it wrote leave the links out)
    target = Path(cluster.checkpoint_root) / f"after-{os.getpid()}-{time.monotonic_ns()}"
    started = time.perf_counter()
    path = await pstrain.Checkpoint(table=model.table, optimizer=opt).save(str(target))
    save_s = time.perf_counter() - started
    saved = list(Path(path).parent.glob(Path(path).name + "*"))
    links = [f for f in saved if ".link-" in f.name]
    written = sum(f.stat().st_size for f in saved if f not in links)
    for f in saved:
        f.unlink()
    return {
        "chain_bytes": nbytes,
        "restore_s": restore_s,
        "plain_read_s": plain,
        "first_plain_read_s": cold_read,
        "restore_over_plain_read": plain / restore_s,
        "rss_mib_during_restore_max_per_ps": [round(x) for x in during],
        "hit_rate_after_restore": 1 - promoted / max(1, looked),
        "save_after_restore_s": save_s,
        "save_after_restore_bytes": written,
        "save_after_restore_links": len(links),
    }


def _over_budget(runs: list[dict], key: str, budget: int) -> list[float]:
    """Of each run that sampled ``key`` (each ps's largest RSS, MiB), the largest rise of a
    ps over its RSS at start, over ``budget``."""
    return [
        max(peak - start for peak, start in zip(r[key], r["rss_mib_at_start_per_ps"])) * (1 << 20) / budget
        for r in runs
        if r.get(key)
    ]


#: Deltas on the base a restore reads, and training steps between two of them.
DELTAS = 10
DELTA_STEPS = 10
#: Training steps after the restore whose hit rate is ``hit_rate_after_restore``.
AFTER_RESTORE_STEPS = 10
#: Saves measured after the first (their median is ``save_over_plain_write``).
SAVES = 3


def uncache(files: list[Path]) -> None:
    """Drop ``files``' pages from the page cache (written and synced: clean pages go), so
    that the next read of them reads the disk; only these files, not the machine's cache."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read_s(files: list[Path]) -> float:
    """Seconds to read ``files`` whole, one after the other, 8 MiB at a time."""
    block = bytearray(8 << 20)
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(block):
                pass
    return time.perf_counter() - started


def plain_write_s(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to ``path`` and sync it (then the file is removed)."""
    block = np.zeros(8 << 20, np.uint8).tobytes()
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - started
    path.unlink()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--budget", default="80MiB", help="each ps's --memory-budget")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--inflight",
        type=int,
        default=2,
        help="closures in flight per worker, in both halves (a tiered table's reads from disk wait "
        "on it: more in flight keep the cores busy meanwhile)",
    )
    parser.add_argument(
        "--table",
        choices=["dynamic", "w7"],
        default="dynamic",
        help="W6's growing table (default), or W7's 25,000,000 x 32 made whole first (W9 as written: "
        "--steps 1200 --budget 512MiB; about 12 GB of disk and 10 GB of RAM)",
    )
    parser.add_argument(
        "--eviction",
        choices=["lru", "lfu"],
        default="lru",
        help="what chooses each shard's hot set (the table's eviction; it has no capacity)",
    )
    args = parser.parse_args()
    if args.inflight < 1:
        parser.error("--inflight must be at least 1")
    variant, warm = ("w7", 200) if args.table == "w7" else ("a", None)
    budget = byte_size(args.budget, "--budget")
    runs: dict[str, list[dict]] = {"ram": [], "tiered": []}
    with tempfile.TemporaryDirectory(prefix="pstrain-w9-") as tier:
        for i in range(args.runs):
            for job in ("ram", "tiered") if i % 2 == 0 else ("tiered", "ram"):
                options: dict[str, Any] = {"checkpoint_root": tier}
                if job == "tiered":
                    options.update(memory_budget=budget, table_dir=tier)
                elif variant == "w7":  # (3.2 GB of rows and slots a ps: past its default limit)
                    options.update(extra_args=["--max-variable-bytes", str(8 << 30)])
                runs[job].append(
                    pstrain.run(
                        run_variant(
                            variant,
                            args.steps,
                            options,
                            sample_s=0.1,
                            after=table_figures,
                            warm=warm,
                            inflight=args.inflight,
                            eviction=args.eviction,
                        )
                    )
                )
    ram, tiered = runs["ram"], runs["tiered"]
    speed = median([r["examples_per_s"] for r in tiered])
    in_ram = median([r["examples_per_s"] for r in ram])
    over = _over_budget(tiered, "rss_mib_samples_max_per_ps", budget)
    over_saves = _over_budget(tiered, "rss_mib_during_saves_max_per_ps", budget)
    over_restore = _over_budget(tiered, "rss_mib_during_restore_max_per_ps", budget)
    last = tiered[-1]["table"]
    per_ps = tiered[-1]["table_per_ps"]
    # the hit rate and reads from disk over the timed steps (the fill and warm-up left out),
    # the median of the rounds
    timed = [(r["table_over_timed_steps"], r["timed_steps"]) for r in tiered]
    hit_rates = [1 - c.get("promoted", 0) / max(1, c.get("looked_up", 0)) for c, _ in timed]
    promoted = [c.get("promoted", 0) / n for c, n in timed]
    made_back = [c.get("made_back", 0) / n for c, n in timed]  # (of those: made again, not read)
    read_back = [(c.get("promoted", 0) - c.get("made_back", 0)) / n for c, n in timed]
    cold_reads = [c.get("cold_reads", 0) / n for c, n in timed]
    # of the rows read from disk, those the serving loop found in the page cache (no thread)
    on_loop = [c.get("cold_rows_from_page_cache", 0) / max(1, c.get("cold_rows_read", 0)) for c, _ in timed]
    emit(
        {
            "workers": 2,
            "ps": 2,
            "table": f"W7's {W7_ROWS:,} x {W7_DIM} as a DynamicEmbedding, every row made first (W4's ids)"
            if variant == "w7"
            else "DynamicEmbedding (W6's ids), not W7's fixed table",
            "fill_s": tiered[-1]["fill_s"],
            "in_ram_fill_s": ram[-1]["fill_s"],
            "budget_bytes_per_ps": budget,
            "metric": "examples_per_s",
            "value": round(speed, 1),
            "in_ram_examples_per_s": round(in_ram, 1),
            # CPU of all five processes a timed step (medians): where the ratio of examples/s
            # and that of CPU part, the tiered half waited rather than worked
            "cpu_ms_per_step": round(median([r["cpu_ms_per_step"] for r in tiered]), 2),
            "in_ram_cpu_ms_per_step": round(median([r["cpu_ms_per_step"] for r in ram]), 2),
            "ratio_to_in_ram": round(speed / in_ram, 3),
            "ratio_to_in_ram_each_round": [
                round(t["examples_per_s"] / r["examples_per_s"], 3) for t, r in zip(tiered, ram)
            ],
            "peak_rss_over_budget": round(median(over), 3),
            "peak_rss_over_budget_each_round": [round(x, 3) for x in over],
            # the same during the full saves after training (sampled every 100 ms too)
            "saves_peak_rss_over_budget": round(median(over_saves), 3),
            # and during the restore in place of a base and its deltas
            "restore_peak_rss_over_budget": round(median(over_restore), 3) if over_restore else None,
            "in_ram_peak_rss_mib_per_ps": ram[-1]["rss_mib_samples_max_per_ps"],
            "tiered_peak_rss_mib_per_ps": tiered[-1]["rss_mib_samples_max_per_ps"],
            "rss_mib_at_start_per_ps": tiered[-1]["rss_mib_at_start_per_ps"],
            "rows": last.get("rows"),
            "rows_in_ram": last.get("hot_rows"),
            "rows_on_disk": last.get("cold_rows"),
            "disk_bytes": last.get("disk_bytes"),
            "hit_rate": round(median(hit_rates), 4),
            "cold_reads_per_step": round(median(cold_reads), 2),
            "rows_back_in_ram_per_step": round(median(promoted), 1),
            "rows_made_back_per_step": round(median(made_back), 1),
            "rows_read_from_disk_per_step": round(median(read_back), 1),
            "rows_read_from_page_cache_on_loop": round(median(on_loop), 3),
            "eviction": tiered[-1]["eviction"],
            "cold_read_p50_us_per_ps": [t.get("cold_read_p50_us") for t in per_ps],
            "cold_read_p99_us_per_ps": [t.get("cold_read_p99_us") for t in per_ps],
            "refused": last.get("refused"),
            "save_over_plain_write": _median(tiered, "save_over_plain_write"),
            "in_ram_save_over_plain_write": _median(ram, "save_over_plain_write"),
            "first_save_over_plain_write": _median(tiered, "first_save_over_plain_write"),
            "in_ram_first_save_over_plain_write": _median(ram, "first_save_over_plain_write"),
            "save_bytes": tiered[-1]["save_bytes"],
            "restore_over_plain_read": _median(tiered, "restore_over_plain_read"),
            "restore_over_plain_read_each_round": [
                None if r.get("restore_over_plain_read") is None else round(r["restore_over_plain_read"], 3)
                for r in tiered
            ],
            "restore_s": _median(tiered, "restore_s"),
            "plain_read_s": _median(tiered, "plain_read_s"),
            "first_plain_read_s": _median(tiered, "first_plain_read_s"),
            "in_ram_restore_over_plain_read": _median(ram, "restore_over_plain_read"),
            "hit_rate_after_restore": _median(tiered, "hit_rate_after_restore"),
            "restore_chain": f"a base and {DELTAS} deltas, {DELTA_STEPS} steps apart",
            "checkpoint": "the table and the optimizer (rows and Adagrad accumulators)",
            "restore_bytes": tiered[-1]["chain_bytes"],
            # the full save after the restore (links), against a plain write of a full save's
            # bytes (the median of the saves before: the same table)
            "save_after_restore_bytes": tiered[-1].get("save_after_restore_bytes"),
            "save_after_restore_links": tiered[-1].get("save_after_restore_links"),
            "save_after_restore_over_plain_write": _median(tiered, "save_after_restore_over_plain_write"),
            "held_out_log_loss": round(median([r["held_out_log_loss"] for r in tiered]), 4),
            "in_ram_held_out_log_loss": round(median([r["held_out_log_loss"] for r in ram]), 4),
            "steps": args.steps,
            "warm_up_steps": warm if warm is not None else max(1, args.steps // 10),
            "runs": args.runs,
            "max_inflight_per_worker": args.inflight,
            "worker_data": WORKER_DATA,
        },
        "W9",
    )


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(median(values), 3) if values else None


if __name__ == "__main__":
    main()
