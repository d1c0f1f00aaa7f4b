"""FifoCache against a model: its bounds hold but for what it must keep, the oldest go
first, and its byte count is the sum of what it holds."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from pstrain._base.caches import FifoCache

pytestmark = pytest.mark.timeout(60)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 15), st.integers(0, 40)),
        st.tuples(st.just("touch"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("discard"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("pin"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("unpin"), st.integers(0, 15), st.just(0)),
    ),
    max_size=80,
)


@given(ops, st.integers(1, 6), st.integers(1, 100))
def test_the_cache_keeps_its_bounds_but_for_what_it_must_keep_and_drops_the_oldest_first(
    steps, max_items, max_bytes
):
    cache: FifoCache[int, str] = FifoCache(max_items, max_bytes)
    model: dict[int, int] = {}  # key -> size, oldest first
    pinned: set[int] = set()
    for op, key, size in steps:
        if op == "put":
            dropped = cache.put(key, f"v{key}", size, keep=pinned.__contains__)
            model.pop(key, None)
            model[key] = size
            expected = []
            items, total = len(model), sum(model.values())
            for old in list(model):
                if items <= max_items and total <= max_bytes:
                    break
                if old != key and old not in pinned:
                    expected.append(old)
                    items, total = items - 1, total - model[old]
            for old in expected:
                del model[old]
            assert dropped == expected
            # over a bound only by the entry just put and the pinned ones
            if len(model) > max_items or sum(model.values()) > max_bytes:
                assert set(model) <= pinned | {key}
        elif op == "touch":
            cache.touch(key)
            if key in model:
                model[key] = model.pop(key)
        elif op == "discard":
            cache.discard(key)
            model.pop(key, None)
        elif op == "pin":
            pinned.add(key)
        else:
            pinned.discard(key)
        assert list(cache.entries) == list(model)
        assert cache.bytes == sum(model.values()) and len(cache) == len(model)
        assert all(cache.get(k) == f"v{k}" for k in model)
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0
