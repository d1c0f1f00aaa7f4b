"""Strings to ids, as TensorFlow hashes them: ``to_hash_bucket_fast`` (TF's
``tf.strings.to_hash_bucket_fast``, what Keras' ``Hashing`` layer does without a salt) and
``fingerprint64``, FarmHash's Fingerprint64 of each string (what TF's
``tf.fingerprint(..., "farmhash64")`` gives, as a number). The same string gets the same
bucket as in a TF pipeline, so features hashed there and here meet the same rows.

A ``str`` is hashed as its UTF-8 bytes (as TF converts it); ``bytes`` as they are. The
result has the input's shape. The hash runs compiled, without Python per byte.

>>> to_hash_bucket_fast(["alice", "bob"], 1000).tolist()
[157, 913]
>>> int(fingerprint64("hello"))
13009744463427800296
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._kernels import KERNELS

__all__ = ["fingerprint64", "to_hash_bucket_fast"]


def fingerprint64(input: Any) -> np.ndarray:  # noqa: A002 - TF's name
    """FarmHash's Fingerprint64 of each string of ``input`` (a string, or an array or nested
    lists of them), as uint64 of the input's shape. ``.view(np.int64)`` makes them ids for
    a ``DynamicEmbedding``."""
    strings = _strings(input, "fingerprint64")
    flat = [_bytes(s) for s in strings.reshape(-1)]
    data = np.frombuffer(b"".join(flat), np.uint8) if flat else np.zeros(0, np.uint8)
    offsets = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([len(b) for b in flat], out=offsets[1:])
    out = KERNELS.fingerprint64(np.ascontiguousarray(data), offsets).reshape(strings.shape)
    return out[()] if out.ndim == 0 else out


def to_hash_bucket_fast(input: Any, num_buckets: int, name: str | None = None) -> np.ndarray:  # noqa: A002
    """Each string of ``input`` to a bucket in ``[0, num_buckets)``: its
    :func:`fingerprint64` modulo ``num_buckets``, as TF's ``to_hash_bucket_fast`` (int64, the
    input's shape)."""
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)) or num_buckets < 1:
        raise InvalidArgumentError(
            f"to_hash_bucket_fast: num_buckets must be an integer of 1 or more, got {num_buckets!r}"
        )
    fingerprints = np.asarray(fingerprint64(input))
    out = (fingerprints % np.uint64(num_buckets)).astype(np.int64)
    return out[()] if out.ndim == 0 else out


def _strings(input: Any, what: str) -> np.ndarray:  # noqa: A002
    arr = np.asarray(input, dtype=object) if not isinstance(input, np.ndarray) else input
    if arr.dtype.kind not in "USO":
        raise InvalidArgumentError(f"{what} takes strings, got an array of {arr.dtype}")
    return arr


def _bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value)
    if isinstance(value, str):  # (np.str_ too)
        return value.encode("utf-8")
    raise InvalidArgumentError(f"strings to hash must be str or bytes, got {type(value).__name__}")


expose(globals(), "pstrain.strings")
