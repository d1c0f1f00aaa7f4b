"""Checksums of checkpoint data: each tensor of a checkpoint or delta file carries the
xxh3-64 digest of every ``CHECK_CHUNK`` bytes of its data, in the file's own header
(``__metadata__`` entry ``xxh3:<key>``: the digests as 16 hex digits each, in order).

Chunks, not whole tensors, so that a reader of some rows (a restore into another
number of ps reads a row range of each part) checks what it reads and at most one
chunk more on each side, never the whole file. A file is written in one pass: its
header goes out first with the digests as zeros, the digests are taken as the data
goes out (:class:`StreamDigests`) and written into the header before the file is
fsynced and given its name (``tensor_files.write_streaming``). Readers check every
chunk they read (:class:`Verifier`): a flipped bit is an error naming the file, the
tensor and the bytes, never a silent restore. Files without digests (written before
they existed) are read unchecked.

xxh3 (the ``xxhash`` package): a non-cryptographic digest at memory speed, so that
checking costs a restore little next to reading; it finds damage, not forgery (the
files are the job's own, under its checkpoint root).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xxhash

from ..._base.errors import InvalidArgumentError

__all__ = [
    "CHECK_CHUNK",
    "DIGEST_PREFIX",
    "StreamDigests",
    "Verifier",
    "chunk_span",
    "digest_entries",
    "digests_of",
    "placeholder",
]

#: Bytes of a tensor's data per digest.
CHECK_CHUNK = 4 << 20
#: The ``__metadata__`` key of a tensor's digests is this prefix and the tensor's key.
DIGEST_PREFIX = "xxh3:"
_HEX = 16  # hex digits of one digest


def _chunks(nbytes: int) -> int:
    return -(-nbytes // CHECK_CHUNK)


def placeholder(nbytes: int) -> str:
    """The digests' place in a header, before they are known: zeros of their length."""
    return "0" * (_HEX * _chunks(nbytes))


def digests_of(data: Any) -> str:
    """The digests of ``data``'s bytes (a buffer), one per ``CHECK_CHUNK``.

    >>> len(digests_of(b"x" * (CHECK_CHUNK + 1))) == 2 * 16
    True
    """
    view = memoryview(data).cast("B")
    return "".join(
        xxhash.xxh3_64_hexdigest(view[lo : lo + CHECK_CHUNK]) for lo in range(0, len(view), CHECK_CHUNK)
    )


def digest_entries(tensors: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The header's ``__metadata__`` entries for tensors ``(key, data bytes)``, zeroed."""
    return {DIGEST_PREFIX + key: placeholder(nbytes) for key, nbytes in tensors}


class StreamDigests:
    """The digests of a file's tensors, taken from its bytes as they go out, in order
    (:meth:`feed`): ``skip`` bytes of header first, then each tensor's data in turn."""

    def __init__(self, skip: int, tensors: Sequence[tuple[str, int]]) -> None:
        self._skip = skip
        self._left = [(key, nbytes) for key, nbytes in tensors]
        self._at = 0  # bytes of the current tensor taken
        self._chunk = xxhash.xxh3_64()
        self._chunk_fill = 0
        self._hex: list[str] = []
        self.digests: dict[str, str] = {}
        self._close_empty()

    def feed(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self._skip:
            n = min(self._skip, len(view))
            self._skip -= n
            view = view[n:]
        while len(view) and self._left:
            key, nbytes = self._left[0]
            take = min(len(view), nbytes - self._at, CHECK_CHUNK - self._chunk_fill)
            self._chunk.update(view[:take])
            view = view[take:]
            self._at += take
            self._chunk_fill += take
            if self._chunk_fill == CHECK_CHUNK or self._at == nbytes:
                self._hex.append(self._chunk.hexdigest())
                self._chunk.reset()
                self._chunk_fill = 0
            if self._at == nbytes:
                self.digests[key] = "".join(self._hex)
                self._hex, self._at = [], 0
                self._left.pop(0)
                self._close_empty()

    def _close_empty(self) -> None:
        while self._left and self._left[0][1] == 0:
            self.digests[self._left.pop(0)[0]] = ""

    @property
    def done(self) -> bool:
        return not self._left


class Verifier:
    """Checks the bytes read of one tensor against its digests: fed the bytes from
    ``start`` (a chunk boundary) in order, each chunk is checked as it is completed;
    :meth:`finish` checks the last one (the tensor's end, or where reading stopped)."""

    def __init__(self, path: str, key: str, digests: str, nbytes: int, start: int = 0) -> None:
        if start % CHECK_CHUNK or len(digests) != _HEX * _chunks(nbytes):
            raise InvalidArgumentError(
                f"{path}: the checksums of {key!r} do not fit its {nbytes} bytes (the file is damaged)"
            )
        self.path, self.key, self.digests, self.nbytes = path, key, digests, nbytes
        self._at = start
        self._chunk = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHECK_CHUNK - self._fill, self.nbytes - self._at - self._fill)
            if take <= 0:
                raise InvalidArgumentError(f"{self.path}: read past the end of {self.key!r}")
            self._chunk.update(view[:take])
            view = view[take:]
            self._fill += take
            if self._fill == CHECK_CHUNK or self._at + self._fill == self.nbytes:
                self._check()

    def finish(self) -> None:
        """The bytes fed end here: they must end a chunk (or the tensor)."""
        if self._fill:
            raise InvalidArgumentError(f"{self.path}: a read of {self.key!r} ended inside a checked chunk")

    def _check(self) -> None:
        index = self._at // CHECK_CHUNK
        want = self.digests[_HEX * index : _HEX * (index + 1)]
        if self._chunk.hexdigest() != want:
            lo = self._at
            raise InvalidArgumentError(
                f"checkpoint file {self.path} is damaged: bytes {lo}..{lo + self._fill} of "
                f"tensor {self.key!r} do not match their checksum (xxh3); restore an "
                "earlier checkpoint"
            )
        self._at += self._fill
        self._fill = 0
        self._chunk.reset()


def chunk_span(lo: int, hi: int, nbytes: int) -> tuple[int, int]:
    """The chunk-aligned bytes that cover ``[lo, hi)`` of a tensor of ``nbytes``."""
    return lo - lo % CHECK_CHUNK, min(nbytes, -(-hi // CHECK_CHUNK) * CHECK_CHUNK)


#: The key of an index's digest of the rest of it (``index_digest``).
INDEX_DIGEST = "digest"


def index_digest(index: dict[str, Any]) -> str:
    """The digest a checkpoint's or a delta's index carries of the rest of it (its JSON
    with sorted keys, no spaces): the checksums of the files cover the tensors, this one
    where they are (a digit of an offset changed by one bit reads as another row).

    >>> index_digest({"b": [1, 2.5], "a": "x"}) == index_digest({"a": "x", "b": [1, 2.5]})
    True
    """
    text = json.dumps(index, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return xxhash.xxh3_64_hexdigest(text.encode())


def with_digest(index: Any) -> dict[str, Any]:
    """``index`` as a reader gets it back from JSON (lists, string keys), with its digest."""
    body: dict[str, Any] = json.loads(json.dumps(index))
    body[INDEX_DIGEST] = index_digest(body)
    return body


def checked_index(path: str, raw: Any) -> Any:
    """``raw`` (an index as read from ``path``) without its digest, which must match the
    rest; an index written before digests has none. InvalidArgumentError if it does not."""
    if isinstance(raw, dict) and INDEX_DIGEST in raw:
        raw = dict(raw)
        digest = raw.pop(INDEX_DIGEST)
        if digest != index_digest(raw):
            raise InvalidArgumentError(f"checkpoint index {path} is damaged: it does not match its digest")
    return raw
