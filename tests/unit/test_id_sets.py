"""The growing hash set of ids a restore composes deltas with (``_kernels.id_sets``),
against Python's set."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain._kernels.id_sets import IdSet

pytestmark = pytest.mark.timeout(120)

ID = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(ID, max_size=300), max_size=8), st.lists(ID, max_size=200))
def test_a_set_holds_what_was_added_as_it_grows(batches, probes):
    s, model = IdSet(), set()
    for batch in batches:
        new = np.array(sorted(set(batch) - model), np.int64)
        s.add(new)
        model |= set(new.tolist())
        assert len(s) == len(model)
        asked = np.array(probes + batch, np.int64)
        assert s.has(asked).tolist() == [x in model for x in asked.tolist()]
    assert sorted(s.ids().tolist()) == sorted(model)
    assert s.nbytes >= 2 * 16 * len(model)  # at most half of its slots taken


def test_minus_one_and_the_extremes_are_ids_like_any_other():
    s = IdSet(1)
    s.add(np.array([-1, 2**63 - 1, -(2**63)], np.int64))
    assert s.has(np.array([-1, 0, 2**63 - 1, -(2**63)], np.int64)).tolist() == [True, False, True, True]


def test_an_empty_set_has_nothing_and_lists_nothing():
    s = IdSet()
    assert not s.has(np.arange(5)).any()
    assert s.ids().size == 0 and len(s) == 0
    s.add(np.empty(0, np.int64))
    assert len(s) == 0
