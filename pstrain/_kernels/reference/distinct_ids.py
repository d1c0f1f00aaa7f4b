"""Distinct ids in numpy: first sightings, ids in a span, ids sorted, a stable sort and
shards of ids."""

from __future__ import annotations

import numpy as np

from .id_index import mix64

__all__ = ["argsort_stable", "id_span", "shard_ids", "unique_first", "unique_in_span", "unique_sorted"]


def unique_first(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sorted_ids, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first)  # the distinct ids by where they first occur
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    return sorted_ids[order], rank[inverse.reshape(-1)]


def id_span(ids: np.ndarray, unsigned: bool = False) -> tuple[int, int, bool]:
    if ids.size == 0:
        raise ValueError("id_span: no ids")
    x = ids.view(np.uint64) if unsigned else ids
    return int(x.min()), int(x.max()), bool(np.all(x[1:] > x[:-1]))


def unique_in_span(ids: np.ndarray, low: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    if span < 1 or span > 1 << 40:
        raise ValueError("unique_in_span: span must be 1 to 2**40")
    if ids.size and (int(ids.min()) < low or int(ids.max()) - low >= span):  # (Python ints: no wrap)
        raise IndexError("unique_in_span: an id outside the span")
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique.astype(np.int64), inverse.reshape(-1).astype(np.int64)


def unique_sorted(
    ids: np.ndarray, unsigned: bool = False, span: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    unique, inverse = np.unique(ids.view(np.uint64) if unsigned else ids, return_inverse=True)
    return unique.view(np.int64), inverse.reshape(-1).astype(np.int64)


def argsort_stable(values: np.ndarray, unsigned: bool = False) -> np.ndarray:
    return np.argsort(values.view(np.uint64) if unsigned else values, kind="stable").astype(np.int64)


def shard_ids(ids: np.ndarray, num_shards: int, salt: int) -> np.ndarray:
    if num_shards < 1:
        raise ValueError("shard_ids: num_shards must be at least 1")
    with np.errstate(over="ignore"):
        h = mix64(ids.view(np.uint64) ^ np.uint64(salt))
    return (h % np.uint64(num_shards)).astype(np.int64)
