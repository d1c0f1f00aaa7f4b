"""The directories tiered ps keep under ``--table-dir`` (:class:`TierDirectory`): whether a
directory's ps lives is its lock, not the process id in its name, which in another PID
namespace names no process, another one, or the ps itself."""

from __future__ import annotations

import os
import time

import pytest

from pstrain.errors import InvalidArgumentError
from pstrain.server.ps.tables.tier_directories import HIDDEN_LEFT_S, TierDirectory

pytestmark = pytest.mark.timeout(60)


def test_a_live_ps_directory_is_kept_whatever_pid_its_name_gives(tmp_path):
    # A ps in another PID namespace: its pid is no process here. Its directory stays.
    live = TierDirectory(str(tmp_path))
    (tmp_path / os.path.basename(live.path) / "segment").write_bytes(b"rows")
    elsewhere = tmp_path / "pstrain-999999999-0badcafe"  # (the directory keeps its lock)
    os.rename(live.path, elsewhere)
    other = TierDirectory(str(tmp_path))
    assert (elsewhere / "segment").read_bytes() == b"rows"
    assert sorted(os.listdir(tmp_path)) == sorted([elsewhere.name, os.path.basename(other.path)])
    other.remove()
    live.remove()  # (its own path is gone: it removes nothing else)
    assert sorted(os.listdir(tmp_path)) == [elsewhere.name]


def test_a_gone_ps_directory_is_removed_even_if_its_pid_is_a_process_now(tmp_path):
    # A ps killed in a container was pid 1 there, as the next one is: no lock, so removed.
    killed = tmp_path / f"pstrain-{os.getpid()}-deadbeef"
    killed.mkdir()
    (killed / "segment").write_bytes(b"rows")
    (tmp_path / "pstrain-1-0000cafe").mkdir()
    (tmp_path / "kept-by-the-user").mkdir()  # not a ps's: left alone
    new = TierDirectory(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(["kept-by-the-user", os.path.basename(new.path)])
    assert os.path.basename(new.path).startswith(f"pstrain-{os.getpid()}-")
    new.remove()
    assert os.listdir(tmp_path) == ["kept-by-the-user"]


def test_a_ps_that_stops_removes_its_directory_and_frees_it_for_no_one_else(tmp_path):
    first, second = TierDirectory(str(tmp_path)), TierDirectory(str(tmp_path))
    assert first.path != second.path and os.path.isdir(first.path) and os.path.isdir(second.path)
    first.remove()
    assert os.listdir(tmp_path) == [os.path.basename(second.path)]
    second.remove()
    second.remove()  # (once is enough: again does nothing)
    assert os.listdir(tmp_path) == []


def test_a_table_dir_that_cannot_hold_directories_is_refused_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgumentError, match="cannot keep its tables' rows there"):
        TierDirectory(str(tmp_path / "file"))
    assert os.listdir(tmp_path) == ["file"]


def test_a_directory_left_by_a_ps_killed_before_it_was_in_place_goes_once_a_minute_old(tmp_path):
    left = tmp_path / ".pstrain-new-0badf00d"  # a ps killed between making and renaming it
    left.mkdir()
    making = tmp_path / ".pstrain-new-5ca1ab1e"  # a ps starting now, about to rename its own
    making.mkdir()
    old = time.time() - HIDDEN_LEFT_S - 5
    os.utime(left, (old, old))
    new = TierDirectory(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([making.name, os.path.basename(new.path)])
    new.remove()
