"""``pstrain status``: every task of a cluster, up or not, and what it is doing."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from .._base.cluster import ClusterSpec, task_name
from .._base.errors import PstrainError
from .._base.resolvers import read_config, read_token
from .arguments import address, seconds

__all__ = ["status", "status_parser"]


STATUS_COLUMNS = """Columns:
  TASK      job:index, as in the cluster spec
  STATE     up; down (no answer within --timeout); refused (wrong token); foreign (not a
            pstrain server, or a TLS mismatch); mismatch (another task answers there)
  ADDRESS   host:port from the cluster spec
  UPTIME    seconds since the task started
  WORK      ps: variables held; worker: closures run; chief: closures done
  BYTES     ps: bytes held, variables and table rows; others: request and reply bytes so far
  REQUESTS  requests per second, measured over one second (chief: closures done per second)"""


def status_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show every task of a cluster: up or down, load",
        description="Probe every task of the cluster (from --cluster, PSTRAIN_CONFIG "
        "or TF_CONFIG) and print a table.\n\n" + STATUS_COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", metavar="FILE", help="cluster config JSON file (TF_CONFIG format)")
    p.add_argument("--token-file", metavar="FILE", help="file holding the cluster token")
    p.add_argument("--timeout", type=seconds, default=2.0, help="seconds before a task counts as down")
    p.add_argument("--verbose", action="store_true", help="also print why each down task is down")
    p.add_argument(
        "--coordinator",
        type=address,
        metavar="HOST:PORT",
        help="also print the running job's worker membership, from its coordinator's "
        "endpoint (workers that joined or left included)",
    )
    p.set_defaults(func=status)


def _load_cluster(path: str | None) -> ClusterSpec:
    config = read_config(path, os.environ)
    if config is None:
        raise PstrainError("no cluster: pass --cluster FILE or set PSTRAIN_CONFIG / TF_CONFIG")
    return config[0]


def _held(stats: dict[str, Any]) -> int:
    """The bytes a ps holds: its variables and its tables' rows (with their slots)."""
    return int(stats.get("bytes", 0)) + sum(int(t.get("bytes", 0)) for t in stats.get("tables", {}).values())


def _tiers(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """One line per tiered table of a ps: its rows in RAM and on disk, the bytes on disk,
    the hit rate of its lookups and its reads from disk per second (both over the one
    second between ``first`` and ``second``; the hit rate since the ps started if nothing
    was looked up then), their latency, how the ps reads (io_uring or ``pread``) and, of
    the rows read from disk in that second, the share the page cache held."""
    lines = []
    for name, t in sorted(second.get("tables", {}).items()):
        if "cold_rows" not in t:
            continue
        before = first.get("tables", {}).get(name, {})
        hit = _hit_rate(t, before)
        reads = max(0, int(t["cold_reads"]) - int(before.get("cold_reads", 0)))
        way = ""
        if int(t["cold_reads"]):  # (a ps that has read nothing yet cannot say how it reads)
            way = ", io_uring" if int(t.get("cold_reads_io_uring", 0)) else ", pread"
        rows, cached = (
            int(t.get(k, 0)) - int(before.get(k, 0)) for k in ("cold_rows_read", "cold_rows_from_page_cache")
        )
        if rows > 0 and before:  # (the page cache served the second's reads, or the disk did)
            way += f", {100 * cached / rows:.0f} % of rows from the page cache"
        lines.append(
            f"{name}: {t['hot_rows']} rows in RAM, {t['cold_rows']} on disk ({_human(t['disk_bytes'])}), "
            f"hit rate {hit}, {reads} reads from disk/s (p50 {t['cold_read_p50_us']} us, "
            f"p99 {t['cold_read_p99_us']} us{way}), {t['refused']} refused"
        )
    return lines


def _hit_rate(now: dict[str, Any], before: dict[str, Any]) -> str:
    """The share of a tiered table's training lookups that found their rows in RAM, over
    the second between two samples (a fill or a restore long past says nothing of the hot
    set now), or since the ps started (said so) if nothing was looked up in that second."""
    looked = int(now["looked_up"]) - int(before.get("looked_up", 0))
    promoted = int(now["promoted"]) - int(before.get("promoted", 0))
    if looked > 0 and before:
        return f"{100 * (1 - promoted / looked):.1f} %"
    looked, promoted = int(now["looked_up"]), int(now["promoted"])
    return f"{100 * (1 - promoted / looked):.1f} % since start" if looked else "-"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


#: What ``pstrain status`` shows for a task that answered wrongly (else "down").
_STATES = {"AuthenticationError": "refused", "ProtocolError": "foreign", "WrongTaskError": "mismatch"}


def status(args: argparse.Namespace) -> int:
    from .._formats.messages.operations import Statistics  # the transport: only when it runs
    from .._transport.bridge import run
    from .._transport.channels import Channel
    from .common import membership

    spec = _load_cluster(args.cluster)
    token = read_token(os.environ, args.token_file)
    tasks = [(job, i) for job in ("chief", "ps", "worker", "evaluator") for i in range(spec.num_tasks(job))]

    async def probe(job: str, i: int) -> dict[str, Any]:
        address = spec.task_address(job, i)
        ch = Channel(address, token=token, task=task_name(job, i), connect_timeout=args.timeout)
        row: dict[str, Any] = {"task": f"{job}:{i}", "address": address, "state": "down"}
        try:
            first = await ch.request(Statistics(), timeout=args.timeout)
            await asyncio.sleep(1.0)
            second = await ch.request(Statistics(), timeout=args.timeout)
        except PstrainError as exc:
            row["state"] = _STATES.get(type(exc).__name__, "down")
            row["error"] = f"{type(exc).__name__}: {exc}"
            return row
        finally:
            await ch.close()
        if second.get("task") not in (None, task_name(job, i)):
            row.update(
                state="mismatch",
                error=f"the task at {address} is {second['task']}, not "
                f"{task_name(job, i)}: the cluster spec does not match the running tasks",
            )
            return row

        def count(stats: dict[str, Any]) -> int:
            return sum(r["count"] for r in stats["requests"].values())

        if job == "chief":  # the coordinator: closures finished per second
            rate = max(0, second.get("closures_done", 0) - first.get("closures_done", 0))
        else:
            rate = max(0, count(second) - count(first) - 1) / 1.0  # minus our own second call
        work = (
            f"{second['variables']} variables"
            if "variables" in second
            else f"{second['closures_run']} closures"
            if "closures_run" in second
            else f"{second.get('closures_done', 0)} done"
        )
        if "variables" in second:  # a ps: what it holds, for the placement map's shares too
            row["held"] = _held(second)
            row["tiers"] = _tiers(first, second)
        row.update(
            state="up",
            uptime=f"{second.get('uptime_s', 0):.0f} s",
            work=work,
            bytes=_human(
                _held(second)
                if "variables" in second
                else sum(r["bytes_in"] + r["bytes_out"] for r in second["requests"].values())
            ),
            rate=f"{rate:.0f}/s",
        )
        return row

    async def main() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(probe(job, i) for job, i in tasks)))

    rows = run(main())
    cols = [
        ("TASK", "task"),
        ("STATE", "state"),
        ("ADDRESS", "address"),
        ("UPTIME", "uptime"),
        ("WORK", "work"),
        ("BYTES", "bytes"),
        ("REQUESTS", "rate"),
    ]
    widths = [max(len(h), *(len(str(r.get(k, "-"))) for r in rows)) for h, k in cols]
    print("  ".join(h.ljust(w) for (h, _), w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(k, "-")).ljust(w) for (_, k), w in zip(cols, widths)))
    print("(pstrain status --help explains the columns)")
    tiered = [(r["task"], line) for r in rows for line in r.get("tiers", ())]
    if tiered:
        print("\ntiered tables (rows in RAM within --memory-budget, the rest on disk):")
        for task, line in tiered:
            print(f"  {task}  {line}")
    for r in rows:
        if r.get("error") and (r["state"] != "down" or args.verbose):
            print(f"{r['task']}: {r['error']}")
    if args.coordinator:
        members, placement = run(membership(args.coordinator, token))
        print(f"\nmembership (from the coordinator at {args.coordinator}):")
        for m in members:
            state = m.get("state") or ("leaving" if m["leaving"] else "up" if m["up"] else "down")
            print(f"  worker {m['index']}  {state:<8} {m['address']}  failures {m['failures']}")
        if placement:
            held = {
                int(r["task"].split(":")[1]): r["held"]
                for r in rows
                if r["task"].startswith("ps:") and "held" in r
            }
            _print_placement(placement, held)
    return 0 if all(r["state"] == "up" for r in rows if not r["task"].startswith("chief")) else 1


def _print_placement(placement: dict[str, Any], held: dict[int, int]) -> None:
    """The placement map: its version, each ps's share (what it holds, its table rows
    included, where it answered), the move or replacement under way."""
    print(
        f"\nplacement map version {placement['version']}, {placement['moves_done']} move(s) done, "
        f"{_human(placement['bytes_moved'])} moved:"
    )
    for p in placement["ps"]:
        tables = ", ".join(
            f"{name} {100 * share:.1f}%" for name, share in sorted(p.get("table_shares", {}).items())
        )
        print(
            f"  ps {p['index']}  {'in' if p['active'] else 'left':<4} {p['address'] or '-'}  "
            f"{_human(held.get(p['index'], p['bytes']))}" + (f"  tables: {tables}" if tables else "")
        )
    moving = placement.get("moving")
    if moving:
        print(
            f"  moving ps {moving['from']} -> ps {moving['to']}: {', '.join(moving['variables'])} "
            f"({moving['seconds']} s)"
        )
    for index in placement.get("replacing", ()):
        print(f"  replacing lost ps {index}")
