"""TFRecord files and ``tf.train.Example`` protos in Python: CRC32C, the records' framing
and the examples' features."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["crc32c", "parse_examples", "tfrecord_split"]


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: np.ndarray, crc: int = 0) -> int:
    c = crc ^ 0xFFFFFFFF
    for b in data.tobytes():
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


_LIST_NAMES = {1: "bytes_list", 2: "float_list", 3: "int64_list"}


class _Cut(Exception):
    pass


def _varint_at(data: bytes, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise _Cut
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value & ((1 << 64) - 1), i
        shift += 7


def _fields(data: bytes, start: int, end: int) -> list[tuple[int, int, Any]]:
    """``(field, wire type, value)`` of a message: a varint's number, a delimited field's
    ``(start, end)``, a fixed one's bytes."""
    out: list[tuple[int, int, Any]] = []
    i = start
    while i < end:
        tag, i = _varint_at(data, i, end)
        field, wire = tag >> 3, tag & 7
        v: Any
        if wire == 0:
            v, i = _varint_at(data, i, end)
        elif wire == 2:
            n, i = _varint_at(data, i, end)
            if n > end - i:
                raise _Cut
            v, i = (i, i + n), i + n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if i + size > end:
                raise _Cut
            v, i = data[i : i + size], i + size
        else:
            raise _Cut
        out.append((field, wire, v))
    return out


def parse_examples(
    records: list[bytes], keys: dict[bytes, int], kinds: bytes
) -> tuple[list[np.ndarray], np.ndarray]:
    nf = len(kinds)
    if any(kind not in b"bfi" for kind in kinds):
        raise ValueError(f"parse_examples: kinds must be b (bytes), f (float32) or i (int64), got {kinds!r}")
    counts = np.full((nf, len(records)), -1, np.int64)
    values: list[list[Any]] = [[] for _ in range(nf)]
    for r, record in enumerate(records):
        per: dict[int, list[Any]] = {}
        try:
            for field, wire, span in _fields(record, 0, len(record)):
                if field != 1 or wire != 2:
                    continue
                for efield, ewire, entry in _fields(record, *span):
                    if efield != 1 or ewire != 2:
                        continue
                    key, value = (entry[0], entry[0]), (entry[0], entry[0])
                    for kfield, kwire, part in _fields(record, *entry):
                        if kwire == 2 and kfield == 1:
                            key = part
                        elif kwire == 2 and kfield == 2:
                            value = part
                    f = keys.get(record[key[0] : key[1]])
                    if f is None:
                        continue
                    kind, lst = 0, (value[0], value[0])
                    for vfield, vwire, part in _fields(record, *value):
                        if 1 <= vfield <= 3 and vwire == 2:
                            kind, lst = vfield, part
                    want = {ord("b"): 1, ord("f"): 2, ord("i"): 3}[kinds[f]]
                    if kind and kind != want:
                        name = record[key[0] : key[1]].decode("utf-8", "replace")
                        raise ValueError(
                            f"record {r}, feature {name!r}: data types don't match: it holds "
                            f"{_LIST_NAMES[kind]}, the spec asks for {_LIST_NAMES[want]}"
                        )
                    per.pop(f, None)  # the last of a key wins
                    if not kind:
                        continue
                    got: list[Any] = []
                    for lfield, lwire, part in _fields(record, *lst):
                        if lfield != 1:
                            continue
                        if want == 1 and lwire == 2:
                            got.append(record[part[0] : part[1]])
                        elif want == 3 and lwire == 0:
                            got.append(part)
                        elif want == 2 and lwire == 5:
                            got.append(part)
                        elif lwire == 2 and want == 2:
                            if (part[1] - part[0]) % 4:
                                raise _Cut
                            raw = record[part[0] : part[1]]
                            got.extend(raw[k : k + 4] for k in range(0, len(raw), 4))
                        elif lwire == 2 and want == 3:
                            i = part[0]
                            while i < part[1]:
                                v, i = _varint_at(record, i, part[1])
                                got.append(v)
                        elif want != 1:
                            raise _Cut
                    per[f] = got
        except _Cut:
            raise ValueError(f"record {r} is not a tf.train.Example (a field is cut or of no kind)") from None
        for f, got in per.items():
            counts[f, r] = len(got)
            values[f].extend(got)
    out: list[np.ndarray] = []
    for f in range(nf):
        if kinds[f] == ord("b"):
            arr = np.empty(len(values[f]), object)
            arr[:] = values[f]
        elif kinds[f] == ord("f"):
            arr = np.frombuffer(b"".join(values[f]), np.float32).copy()
        else:
            arr = np.array(values[f], np.uint64).view(np.int64) if values[f] else np.zeros(0, np.int64)
        out.append(arr)
    return out, counts


def _masked_crc(data: bytes) -> int:
    crc = crc32c(np.frombuffer(data, np.uint8))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_split(buf: np.ndarray) -> tuple[list[bytes], int, int, int, int]:
    raw, at = buf.tobytes(), 0
    records: list[bytes] = []
    while len(raw) - at >= 12:
        length = int.from_bytes(raw[at : at + 8], "little")
        if _masked_crc(raw[at : at + 8]) != int.from_bytes(raw[at + 8 : at + 12], "little"):
            return records, at, 1, at, 0
        if length > len(raw) - at - 16:
            return records, at, 0, at, length + 16 - (len(raw) - at)
        data = raw[at + 12 : at + 12 + length]
        if _masked_crc(data) != int.from_bytes(raw[at + 12 + length : at + 16 + length], "little"):
            return records, at, 2, at, 0
        records.append(data)
        at += 16 + length
    return records, at, 0, at, 0
