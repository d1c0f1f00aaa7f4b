"""The move planner, without I/O: which variables move when a ps joins, where variables put
back go, and what each ps holds."""

from __future__ import annotations

from pstrain._coordinator.elastic.plans import (
    plan_leave,
    plan_variables_join,
    spread,
    variable_shares,
    variables_on,
)
from pstrain._formats.messages.placement_map import PlacementMap, TableSlices

#: key -> (the ps it was created on, bytes)
PLACED = {"a": (0, 400), "b": (0, 300), "c": (0, 100), "d": (1, 200), "e": (1, 50)}


def test_shares_count_each_variable_where_the_map_puts_it():
    m = PlacementMap(version=1, ps=["h:1", "h:2", "h:3"])
    assert variable_shares(m, PLACED) == {0: 800, 1: 250, 2: 0}
    moved = m.moved_to({"a": 2}, {"a": 0})
    assert variable_shares(moved, PLACED) == {0: 400, 1: 250, 2: 400}
    assert variables_on(moved, PLACED, 0) == ["b", "c"]  # largest first


def test_a_joining_ps_takes_the_largest_of_the_fullest_while_it_stays_below_them():
    m = PlacementMap(version=1, ps=["h:1", "h:2", "h:3"])
    plan = plan_variables_join(m, PLACED, 2)
    # ps 0 holds 800: "a" (400) leaves ps 2 below it (400 < 800) and moves; then ps 0 holds
    # 400, and neither "b" (300 + 400) nor "c" (100 + 400) would leave ps 2 below it
    assert plan == [["a"]]
    assert variable_shares(m.moved_to({"a": 2}, {"a": 0}), PLACED) == {0: 400, 1: 250, 2: 400}


def test_a_join_into_an_even_job_moves_nothing():
    placed = {"a": (0, 100), "b": (1, 100)}
    m = PlacementMap(version=1, ps=["h:1", "h:2", "h:3"])
    assert plan_variables_join(m, placed, 2) == []


def test_variables_put_back_go_largest_first_to_the_least_loaded_or_where_told():
    m = PlacementMap(version=1, ps=["h:1", "h:2", ""])  # ps 2 gone
    placed = {"x": (0, 10), "y": (1, 500), "big": (2, 300), "small": (2, 100)}
    assert spread(m, placed, ["big", "small"]) == {"big": 0, "small": 0}
    assert spread(m, placed, ["big", "small"], to=1) == {"big": 1, "small": 1}


def test_a_leaving_ps_slices_go_to_the_ps_staying_not_to_another_leaving():
    class Table:
        key, num_ps = "t", 3

    m = PlacementMap(version=1, ps=["h:1", "h:2", "h:3"]).with_tables(
        {"t": TableSlices(slices=6, owners=[0, 1, 2, 0, 1, 2])}
    )
    assert plan_leave(m, {"t": Table()}, 0) == {1: {"t": [0]}, 2: {"t": [3]}}
    # ps 1 is leaving too (its own leave under way): everything goes to ps 2
    assert plan_leave(m, {"t": Table()}, 0, leaving={1}) == {2: {"t": [0, 3]}}
