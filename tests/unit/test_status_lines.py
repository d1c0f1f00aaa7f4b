"""``pstrain status``'s line for a tiered table, from two of a ps's statistics a second
apart."""

from __future__ import annotations

import pytest

from pstrain.cli.status import _tiers

pytestmark = pytest.mark.timeout(30)


def _stats(looked_up: int, promoted: int, cold_reads: int) -> dict:
    table = {
        "hot_rows": 10,
        "cold_rows": 90,
        "disk_bytes": 9000,
        "looked_up": looked_up,
        "promoted": promoted,
        "cold_reads": cold_reads,
        "cold_reads_io_uring": 1,
        "cold_read_p50_us": 5,
        "cold_read_p99_us": 50,
        "refused": 0,
    }
    return {"tables": {"emb": table, "fixed": {"rows": 3}}}


def test_the_hit_rate_is_the_last_seconds_not_the_whole_runs():
    # A fill read 1,000 rows back out of 10,000 looked up; in the last second 100 lookups
    # read 60 back: the hot set finds 40 % now, not the 89.4 % of the whole run.
    (line,) = _tiers(_stats(10_000, 1_000, 50), _stats(10_100, 1_060, 53))
    assert line == (
        "emb: 10 rows in RAM, 90 on disk (9.0 KB), hit rate 40.0 %, 3 reads from disk/s "
        "(p50 5 us, p99 50 us, io_uring), 0 refused"
    )


def test_with_no_lookup_in_that_second_the_hit_rate_is_the_whole_runs_said_so():
    (line,) = _tiers(_stats(10_000, 1_000, 50), _stats(10_000, 1_000, 50))
    assert "hit rate 90.0 % since start, 0 reads from disk/s" in line
    (line,) = _tiers({}, _stats(0, 0, 0))
    assert "hit rate -," in line


def test_the_share_of_rows_the_page_cache_held_is_the_last_seconds():
    # 400 rows read from disk in the last second, 300 of them found in the page cache (read
    # on the serving loop); before that, every row read was in the page cache
    first, second = _stats(10_000, 1_000, 50), _stats(10_100, 1_060, 53)
    first["tables"]["emb"].update(cold_rows_read=1_000, cold_rows_from_page_cache=1_000)
    second["tables"]["emb"].update(cold_rows_read=1_400, cold_rows_from_page_cache=1_300)
    (line,) = _tiers(first, second)
    assert "(p50 5 us, p99 50 us, io_uring, 75 % of rows from the page cache), 0 refused" in line
    (line,) = _tiers(second, second)  # nothing read in that second: no share said
    assert "io_uring), 0 refused" in line
