"""Prometheus metrics for every task, collected when scraped.

Servers keep plain counters (requests, bytes, seconds per operation); a
collector turns them into Prometheus families only when ``GET /metrics`` is
asked, so serving a request costs one timer read and a few additions. Each
server has its own registry (several may share a process in tests).

The coordinator has counters too (queued, in flight, retried): its endpoint
(``pstrain._coordinator.endpoint``) is a server like the others and serves them the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "make_registry", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Collector:
    def __init__(self, labels: dict[str, str], stats: Callable[[], dict[str, Any]]) -> None:
        self.labels = labels
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        requests = CounterMetricFamily(
            "pstrain_requests", "Requests served, by operation", labels=[*names, "op"]
        )
        bytes_in = CounterMetricFamily(
            "pstrain_request_received_bytes", "Request body bytes received", labels=[*names, "op"]
        )
        bytes_out = CounterMetricFamily(
            "pstrain_reply_sent_bytes", "Reply body bytes sent", labels=[*names, "op"]
        )
        latency = SummaryMetricFamily(
            "pstrain_request_seconds", "Time spent handling requests", labels=[*names, "op"]
        )
        for op, r in s.get("requests", {}).items():
            requests.add_metric([*values, op], r["count"])
            bytes_in.add_metric([*values, op], r["bytes_in"])
            bytes_out.add_metric([*values, op], r["bytes_out"])
            latency.add_metric([*values, op], count_value=r["count"], sum_value=r.get("seconds", 0.0))
        yield from (requests, bytes_in, bytes_out, latency)
        for key, (kind, help_text, *metric) in _EXTRA.items():
            if key in s and s[key] is not None:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    f"pstrain_{metric[0] if metric else key}", help_text, labels=names
                )
                family.add_metric(values, float(s[key]))
                yield family
        if "closure_seconds" in s:
            fam = SummaryMetricFamily("pstrain_worker_closure_seconds", "Closure run time", labels=names)
            fam.add_metric(
                values,
                count_value=s.get("closures_run", 0) + s.get("closures_failed", 0),
                sum_value=s["closure_seconds"],
            )
            yield fam
        tables = s.get("tables")
        if tables:
            for key, kind, help_text in _TABLE:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    f"pstrain_table_{key}", help_text, labels=[*names, "table"]
                )
                for table, t in sorted(tables.items()):
                    family.add_metric([*values, table], float(t.get(key, 0)))
                yield family
        placement = s.get("placement")
        if placement:
            shares = GaugeMetricFamily(
                "pstrain_placement_ps_bytes",
                "Bytes of variables each ps holds by the placement map (0: none, or it left)",
                labels=[*names, "ps"],
            )
            for ps in placement.get("ps", ()):
                shares.add_metric([*values, str(ps["index"])], float(ps["bytes"]))
            yield shares
            tables = GaugeMetricFamily(
                "pstrain_placement_table_share",
                "Fraction of each dynamic table's hash space each ps holds by the placement map",
                labels=[*names, "ps", "table"],
            )
            for ps in placement.get("ps", ()):
                for table, share in sorted(ps.get("table_shares", {}).items()):
                    tables.add_metric([*values, str(ps["index"]), table], float(share))
            yield tables
        up = GaugeMetricFamily("pstrain_uptime_seconds", "Seconds since the server started", labels=names)
        up.add_metric(values, s.get("uptime_s", 0.0))
        yield up


#: statistics key -> (kind, help, metric name if not the key): units in names, counters
#: exported with ``_total``, labels ``role`` and ``task`` (the task's index).
_EXTRA: dict[str, tuple[str, ...]] = {
    "preauth_waiting": ("gauge", "Connections waiting to authenticate"),
    "preauth_expired": ("counter", "Connections closed for not authenticating in time"),
    "preauth_evicted": ("counter", "Waiting connections dropped to make room (the cap)"),
    "rss_bytes": ("gauge", "Resident memory of this process", "resident_memory_bytes"),
    "variables": ("gauge", "Variables held by this ps"),
    "bytes": ("gauge", "Bytes of variables held by this ps", "variable_bytes"),
    "closures_run": ("counter", "Closures this worker ran successfully"),
    "closures_failed": ("counter", "Closures that raised on this worker"),
    "closures_running": ("gauge", "Closures running on this worker now"),
    "resources": ("gauge", "Per-worker resources (datasets, iterators) on this worker"),
    "queued": ("gauge", "Closures queued on the coordinator"),
    "in_flight": ("gauge", "Closures running on workers"),
    "closures_done": ("counter", "Closures finished (any outcome)"),
    "closures_retried": ("counter", "Closures put back after their worker failed"),
    "worker_failures": ("counter", "Worker failures seen by the coordinator"),
    "placement_version": ("gauge", "Version of the placement map (which ps holds what)"),
    "moves_in_progress": ("gauge", "Moves of variables between ps under way"),
    "placement_refusals": ("counter", "Requests refused because a variable they name moved"),
    "ps_moves": ("counter", "Moves of variables between ps finished"),
    "ps_moved_bytes": ("counter", "Bytes of variables (and slots) moved between ps"),
    "ps_replaced": ("counter", "Lost ps whose variables were put on the others from a checkpoint"),
    "closures_held": ("gauge", "Closures held until a lost ps is replaced"),
}


_TABLE = (
    ("rows", "gauge", "Rows a dynamic table holds on this ps"),
    ("admitted", "counter", "Rows admitted into a dynamic table on this ps"),
    ("evicted", "counter", "Rows evicted from a dynamic table on this ps"),
    ("bytes", "gauge", "Bytes a dynamic table takes on this ps (rows, slots, index)"),
    ("capacity", "gauge", "Rows a dynamic table may hold on this ps (0: no limit)"),
    # tiered tables (a ps with --memory-budget and --table-dir); 0 for tables wholly in RAM
    ("hot_rows", "gauge", "Rows of a tiered table in RAM on this ps"),
    ("cold_rows", "gauge", "Rows of a tiered table on this ps's disk"),
    ("disk_bytes", "gauge", "Bytes a tiered table's rows take on this ps's disk (dead records too)"),
    ("looked_up", "counter", "Ids of training lookups of a tiered table on this ps"),
    ("promoted", "counter", "Rows of a tiered table read back from disk into RAM on this ps"),
    (
        "made_back",
        "counter",
        "Rows of a tiered table put back in RAM on this ps as the table made them, made again, not read",
    ),
    (
        "read_through",
        "counter",
        "Rows of a tiered table read from this ps's disk for lookups that do not train, left there",
    ),
    ("demoted", "counter", "Rows of a tiered table moved from RAM to disk on this ps"),
    ("compacted", "counter", "Rows of a tiered table copied out of half-dead segments on this ps's disk"),
    (
        "cold_reads",
        "counter",
        "Reads of a tiered table's rows from this ps's disk (one per request; two where the page "
        "cache held only some of its rows, the rest read on a thread)",
    ),
    (
        "cold_rows_from_page_cache",
        "counter",
        "Rows of a tiered table read from this ps's disk that its serving loop found in the page cache",
    ),
    ("cold_read_p50_us", "gauge", "Median latency of the last 1024 reads from disk, in microseconds"),
    (
        "cold_read_p99_us",
        "gauge",
        "99th percentile latency of the last 1024 reads from disk, in microseconds",
    ),
    (
        "cold_reads_io_uring",
        "gauge",
        "1 if this ps reads a tiered table's rows from disk through io_uring, 0 if by pread (or none yet)",
    ),
    ("refused", "counter", "Requests a tiered table refused: past the budget, or the disk full"),
    (
        "sightings_shed",
        "counter",
        "Times a tiered table forgot the older half of its admission sightings for the budget",
    ),
)


def make_registry(labels: dict[str, str], stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(labels, stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
