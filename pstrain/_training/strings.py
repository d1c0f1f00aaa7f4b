"""Strings to ids, as TensorFlow hashes them: ``to_hash_bucket_fast`` (TF's
``tf.strings.to_hash_bucket_fast``, what Keras' ``Hashing`` layer does without a salt),
``to_hash_bucket_strong`` (TF's, SipHash-2-4 with a 128-bit key: Keras' ``Hashing`` with a
``salt``, ``salt=s`` being the key ``[s, s]``) and ``fingerprint64``, FarmHash's
Fingerprint64 of each string (what TF's ``tf.fingerprint(..., "farmhash64")`` gives, as a
number). The same string gets the same
bucket as in a TF pipeline, so features hashed there and here meet the same rows.

A ``str`` is hashed as its UTF-8 bytes (as TF converts it); ``bytes`` as they are. The
result has the input's shape. The hash runs compiled, without Python per byte.

>>> to_hash_bucket_fast(["alice", "bob"], 1000).tolist()
[157, 913]
>>> int(fingerprint64("hello"))
13009744463427800296
>>> to_hash_bucket_strong(["A", "B", "C", "D", "E"], 3, [133, 137]).tolist()  # Keras' example
[1, 2, 1, 0, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._kernels import KERNELS

__all__ = ["fingerprint64", "to_hash_bucket_fast", "to_hash_bucket_strong"]


def fingerprint64(input: Any) -> np.ndarray:  # noqa: A002 - TF's name
    """FarmHash's Fingerprint64 of each string of ``input`` (a string, or an array or nested
    lists of them), as uint64 of the input's shape. ``.view(np.int64)`` makes them ids for
    a ``DynamicEmbedding``."""
    strings = _strings(input, "fingerprint64")
    out = KERNELS.fingerprint64(*_packed(strings)).reshape(strings.shape)
    return out[()] if out.ndim == 0 else out


def to_hash_bucket_fast(input: Any, num_buckets: int, name: str | None = None) -> np.ndarray:  # noqa: A002
    """Each string of ``input`` to a bucket in ``[0, num_buckets)``: its
    :func:`fingerprint64` modulo ``num_buckets``, as TF's ``to_hash_bucket_fast`` (int64, the
    input's shape)."""
    _num_buckets(num_buckets, "to_hash_bucket_fast")
    return _buckets(np.asarray(fingerprint64(input)), num_buckets)


def to_hash_bucket_strong(
    input: Any,  # noqa: A002 - TF's name
    num_buckets: int,
    key: Sequence[int],
    name: str | None = None,
) -> np.ndarray:
    """Each string of ``input`` to a bucket in ``[0, num_buckets)``: its SipHash-2-4 under the
    128-bit ``key`` (two integers, each taken as 64 bits, as TF takes them) modulo
    ``num_buckets``, as TF's ``to_hash_bucket_strong`` (int64, the input's shape). Keras'
    ``Hashing(num_bins, salt=s)`` is ``key=[s, s]`` (or ``salt`` itself, given as two)."""
    _num_buckets(num_buckets, "to_hash_bucket_strong")
    words = list(key) if isinstance(key, (list, tuple, np.ndarray)) else None
    if (
        words is None
        or len(words) != 2
        or not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in words)
        or not all(-(2**63) <= int(k) < 2**64 for k in words)
    ):
        raise InvalidArgumentError(f"to_hash_bucket_strong: key must be two 64-bit integers, got {key!r}")
    k0, k1 = (int(k) % 2**64 for k in words)
    strings = _strings(input, "to_hash_bucket_strong")
    hashes = KERNELS.siphash24(*_packed(strings), k0, k1).reshape(strings.shape)
    return _buckets(hashes, num_buckets)


def _num_buckets(num_buckets: Any, what: str) -> None:
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)) or num_buckets < 1:
        raise InvalidArgumentError(
            f"{what}: num_buckets must be an integer of 1 or more, got {num_buckets!r}"
        )


def _buckets(hashes: np.ndarray, num_buckets: int) -> np.ndarray:
    out = (hashes % np.uint64(num_buckets)).astype(np.int64)
    return out[()] if out.ndim == 0 else out


def _packed(strings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The strings' bytes end to end, and where each starts, then the end."""
    fixed = _packed_fixed(strings)
    if fixed is not None:
        return fixed
    flat = [_bytes(s) for s in strings.reshape(-1)]
    data = np.frombuffer(b"".join(flat), np.uint8) if flat else np.zeros(0, np.uint8)
    offsets = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([len(b) for b in flat], out=offsets[1:])
    return np.ascontiguousarray(data), offsets


def _packed_fixed(strings: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_packed` of an array of fixed-width strings in whole-array passes, no Python
    per string: numpy's bytes (``S``), or its ``str`` (``U``) when every character is ASCII
    (its UTF-8 bytes are then its code points). As numpy reads such an array, a string's
    trailing NULs are not part of it. None for any other array (a ``str`` array with other
    characters is encoded string by string)."""
    if strings.dtype.kind not in "SU" or not strings.size or not strings.dtype.itemsize:
        return None
    n = strings.size
    units: np.ndarray
    if strings.dtype.kind == "S":
        units = np.ascontiguousarray(strings).reshape(n).view(np.uint8).reshape(n, -1)
    else:
        units = np.ascontiguousarray(strings).reshape(n).view(np.uint32).reshape(n, -1)
        if int(units.max()) >= 0x80:
            return None
    width = units.shape[1]
    used = units != 0
    lengths = np.where(used.any(axis=1), width - np.argmax(used[:, ::-1], axis=1), 0)
    data = units[np.arange(width) < lengths[:, None]].astype(np.uint8)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.ascontiguousarray(data), offsets


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
