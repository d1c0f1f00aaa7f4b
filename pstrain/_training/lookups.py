"""Keras' preprocessing of categorical features, for a ``dataset_fn``: the vocabulary
lookups ``StringLookup`` and ``IntegerLookup`` (``tf.keras.layers``), turning raw features
(strings, or integers of any range) into the row ids of a table, as TensorFlow's
parameter-server tutorial does in its dataset; the hashing ``Hashing`` and
``HashedCrossing`` (a feature cross: Wide & Deep's), bins as TensorFlow computes them; and
``Discretization``, numbers to bucket ids (an age to its band's row), with the boundaries
Keras' ``adapt`` finds.

The indices are Keras': the mask token's 0 (when there is one), then ``num_oov_indices``
indices for tokens not in the vocabulary, then the vocabulary in its order. With more than
one OOV index, a string goes to ``to_hash_bucket_fast(token, num_oov_indices)`` (FarmHash,
as Keras), an integer to ``token % num_oov_indices`` (``oov_method="floormod"``) or to the
FarmHash of its decimal string (``"farmhash"``). ``adapt(data)`` makes the vocabulary from
data: the tokens by count, most frequent first, ties broken by the larger token, the mask
token left out, at most ``max_tokens`` indices in all. ``invert=True`` maps indices back to
tokens (``oov_token`` for indices of no token).

Strings compare as UTF-8 bytes: a vocabulary of ``str`` and inputs of ``bytes`` (what
``TextLineDataset`` and ``decode_csv`` give) match, and inverted lookups give ``str``.
Only ``output_mode="int"`` is here; Keras' other modes (one-hot, multi-hot, counts, TF-IDF)
are refused by name.

``Hashing(num_bins)`` is ``to_hash_bucket_fast`` of each value (an integer's decimal string;
a float's, cast to an integer first), or ``to_hash_bucket_strong`` under ``salt``; with a
``mask_value``, that value is bin 0 and the others hash into the remaining ``num_bins - 1``.
``HashedCrossing(num_bins)`` crosses one value of each feature per example, as TensorFlow's
``tf.sparse.cross_hashed``: FarmHash's Fingerprint64 of a string (an integer as itself),
folded into the key ``0xDECAFCAFFE`` feature after feature by ``FingerprintCat64``, modulo
``num_bins``.
"""

from __future__ import annotations

import abc
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .c_numbers import c_int
from .strings import fingerprint64, to_hash_bucket_fast, to_hash_bucket_strong

__all__ = ["Discretization", "HashedCrossing", "Hashing", "IntegerLookup", "StringLookup"]


def _file_lines(path: Any, kind: str) -> list[bytes]:
    """A vocabulary file's lines, as TF's ``TextFileInitializer`` (Keras' reader) reads
    them: each without its ``\\n`` and one ``\\r`` before it; an empty line is refused, as
    TF refuses it."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # (after a last line break, no line)
    out = []
    for number, line in enumerate(lines, 1):
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            raise InvalidArgumentError(f"{kind}: vocabulary file {path}: line {number} is empty")
        out.append(line)
    return out


class _Lookup(abc.ABC):
    """What the two lookups share: the index layout, the table and its refusals."""

    _kind = "StringLookup"

    def __init__(
        self,
        max_tokens: int | None,
        num_oov_indices: int,
        mask_token: Any,
        oov_token: Any,
        vocabulary: Any,
        invert: bool,
        output_mode: str,
        idf_weights: Any,
        sparse: bool,
        pad_to_max_tokens: bool,
    ) -> None:
        if output_mode != "int":
            raise InvalidArgumentError(
                f"{self._kind}: output_mode {output_mode!r} is not supported here, only 'int' "
                "(encode the indices in the model: one-hot is np.eye(size)[ids])"
            )
        if idf_weights is not None or sparse or pad_to_max_tokens:
            raise InvalidArgumentError(
                f"{self._kind}: idf_weights, sparse and pad_to_max_tokens go with Keras' other "
                "output modes, which are not supported here"
            )
        if not isinstance(num_oov_indices, int) or num_oov_indices < 0:
            raise InvalidArgumentError(
                f"{self._kind}: num_oov_indices must be an integer >= 0, got {num_oov_indices!r}"
            )
        if max_tokens is not None and max_tokens <= 1:
            raise InvalidArgumentError(f"{self._kind}: max_tokens must be greater than 1, got {max_tokens}")
        self.max_tokens, self.num_oov_indices, self.invert = max_tokens, num_oov_indices, bool(invert)
        self.mask_token, self.oov_token = mask_token, oov_token
        self.output_mode = output_mode
        self._tokens: list[Any] = []
        self._index: dict[Any, int] = {}  # key -> index (the mask token's too)
        self._set_tokens([])
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    # -- the vocabulary ---------------------------------------------------------------------
    def _oov_start(self) -> int:
        return 0 if self.mask_token is None else 1

    def _token_start(self) -> int:
        return self._oov_start() + self.num_oov_indices

    @abc.abstractmethod
    def _key(self, token: Any) -> Any:
        """A token as the table keys it (refused by name if of the wrong kind)."""

    @abc.abstractmethod
    def _out(self, key: Any) -> Any:
        """A key as the vocabulary gives it back."""

    @abc.abstractmethod
    def _read_file(self, path: Any) -> list[Any]:
        """The tokens of a vocabulary file, a line each."""

    def set_vocabulary(self, vocabulary: Any, idf_weights: Any = None) -> None:
        """The vocabulary (a list, an array or a file of a token per line): a list or array
        with or without the mask and OOV tokens at its start (exactly as
        :meth:`get_vocabulary` gives them); a file's lines are its tokens, each of them, as
        Keras reads a file (through TF's ``TextFileInitializer``)."""
        if idf_weights is not None:
            raise InvalidArgumentError(f"{self._kind}: idf_weights go with output_mode 'tf_idf'")
        from_file = isinstance(vocabulary, (str, os.PathLike))
        given = self._read_file(vocabulary) if from_file else vocabulary
        keys = [self._key(t) for t in np.asarray(given).reshape(-1).tolist()]
        if not keys:
            raise InvalidArgumentError(f"{self._kind}: the vocabulary is empty")
        special = [] if self.mask_token is None else [self._key(self.mask_token)]
        if self.num_oov_indices:
            special += [self._key(self.oov_token)] * self.num_oov_indices
        if not from_file and keys[: len(special)] == special:
            keys = keys[len(special) :]
        repeated = sorted({repr(self._out(k)) for k, n in Counter(keys).items() if n > 1})
        if repeated:
            raise InvalidArgumentError(f"{self._kind}: the vocabulary repeats {', '.join(repeated)}")
        if self.mask_token is not None and self._key(self.mask_token) in keys:
            raise InvalidArgumentError(
                f"{self._kind}: the mask token {self.mask_token!r} is in the vocabulary (give it "
                "only at its start, before the OOV tokens, or not at all)"
            )
        if self.invert and self.oov_token is not None and self._key(self.oov_token) in keys:
            raise InvalidArgumentError(
                f"{self._kind}: the OOV token {self.oov_token!r} is in the vocabulary of an "
                "inverted lookup (give it only at its start, or not at all)"
            )
        size = self._token_start() + len(keys)
        if self.max_tokens is not None and size > self.max_tokens:
            raise InvalidArgumentError(
                f"{self._kind}: the vocabulary makes {size} indices, past max_tokens={self.max_tokens}"
            )
        self._set_tokens(keys)

    def adapt(self, data: Any, batch_size: int | None = None, steps: int | None = None) -> None:
        """The vocabulary from ``data`` (an array, or an iterable of arrays such as a
        dataset's batches): its tokens by count, most frequent first (ties: the larger token
        first), the mask token left out, cut to ``max_tokens`` indices in all."""
        counts: Counter[Any] = Counter()
        batches: Iterable[Any] = [data] if isinstance(data, (np.ndarray, list, tuple)) else data
        for k, batch in enumerate(batches):
            if steps is not None and k >= steps:
                break
            counts.update(self._key(t) for t in np.asarray(batch).reshape(-1).tolist())
        if self.mask_token is not None:
            counts.pop(self._key(self.mask_token), None)
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        keep = None if self.max_tokens is None else max(0, self.max_tokens - self._token_start())
        self._set_tokens([k for k, _ in ranked[:keep]])

    def _set_tokens(self, keys: list[Any]) -> None:
        """The vocabulary's keys, in index order."""
        self._tokens = keys
        self._index = {k: self._token_start() + i for i, k in enumerate(keys)}
        if self.mask_token is not None:
            self._index[self._key(self.mask_token)] = 0

    def get_vocabulary(self, include_special_tokens: bool = True) -> list[Any]:
        """Every index's token, in order: the mask and OOV tokens first (with
        ``include_special_tokens``), then the vocabulary."""
        special = [self.mask_token] * self._oov_start() + [self.oov_token] * self.num_oov_indices
        tokens = [self._out(k) for k in self._tokens]
        return special + tokens if include_special_tokens else tokens

    def vocabulary_size(self) -> int:
        """The number of indices: the vocabulary's, the mask's and the OOV indices."""
        return self._token_start() + len(self._tokens)

    # -- a lookup ---------------------------------------------------------------------------
    def __call__(self, inputs: Any) -> np.ndarray:
        arr = np.asarray(inputs)
        if self.invert:
            return self._inverted(arr)
        if not self._tokens and self.num_oov_indices == 0:
            raise InvalidArgumentError(f"{self._kind}: no vocabulary yet (give one, or adapt)")
        flat = arr.reshape(-1)
        out = self._indices(flat)
        missing = np.flatnonzero(out < 0)
        if missing.size:
            if self.num_oov_indices == 0:
                shown = ", ".join(repr(self._out(self._key(t))) for t in flat[missing[:5]].tolist())
                raise InvalidArgumentError(
                    f"{self._kind}: with num_oov_indices=0 every input must be in the "
                    f"vocabulary; {shown} {'is' if missing.size == 1 else 'are'} not "
                    "(consider num_oov_indices=1)"
                )
            out[missing] = self._oov_start() + self._oov_of(flat[missing])
        return out.reshape(arr.shape)

    @abc.abstractmethod
    def _indices(self, flat: np.ndarray) -> np.ndarray:
        """Each input's index (the mask's 0), -1 for those not in the vocabulary."""

    @abc.abstractmethod
    def _oov_of(self, values: np.ndarray) -> np.ndarray:
        """Each OOV input's index among the OOV indices."""

    def _inverted(self, arr: np.ndarray) -> np.ndarray:
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{self._kind}(invert=True) takes integer indices, got {arr.dtype}")
        vocabulary = self.get_vocabulary()
        table = np.empty(len(vocabulary) + 1, object)
        table[: len(vocabulary)] = vocabulary
        table[-1] = self.oov_token
        idx = arr.astype(np.int64)
        idx = np.where((idx < 0) | (idx >= len(vocabulary)), len(vocabulary), idx)
        if self.num_oov_indices:  # an OOV index is the OOV token, as any index of no token
            idx = np.where((idx >= self._oov_start()) & (idx < self._token_start()), len(vocabulary), idx)
        return self._as_output(table[idx])

    def _as_output(self, tokens: np.ndarray) -> np.ndarray:
        return tokens


class StringLookup(_Lookup):
    """Keras' ``StringLookup``: strings to indices (see the module's docstring). Keras'
    arguments and defaults; ``encoding`` and ``name`` are accepted."""

    _kind = "StringLookup"

    def __init__(
        self,
        max_tokens: int | None = None,
        num_oov_indices: int = 1,
        mask_token: str | None = None,
        oov_token: str = "[UNK]",
        vocabulary: Any = None,
        idf_weights: Any = None,
        invert: bool = False,
        output_mode: str = "int",
        pad_to_max_tokens: bool = False,
        sparse: bool = False,
        encoding: str = "utf-8",
        name: str | None = None,
    ) -> None:
        self.encoding, self.name = encoding, name
        super().__init__(
            max_tokens,
            num_oov_indices,
            mask_token,
            oov_token,
            vocabulary,
            invert,
            output_mode,
            idf_weights,
            sparse,
            pad_to_max_tokens,
        )

    def _set_tokens(self, keys: list[Any]) -> None:
        super()._set_tokens(keys)
        self._by_str: dict[str, int] | None = None  # the same, keyed by str (made when asked)

    def _key(self, token: Any) -> bytes:
        if isinstance(token, bytes):
            return token
        if isinstance(token, str):
            return token.encode(self.encoding)
        raise InvalidArgumentError(f"StringLookup takes strings, got {type(token).__name__} {token!r}")

    def _out(self, key: bytes) -> str:
        return key.decode(self.encoding)

    def _indices(self, flat: np.ndarray) -> np.ndarray:
        # a dictionary lookup a string (as fast as numpy's string arrays sort or search); a
        # str array's strings against the vocabulary as str (not encoded one by one)
        if flat.dtype.kind == "U":
            if self._by_str is None:
                self._by_str = {k.decode(self.encoding): i for k, i in self._index.items()}
            table, keys = self._by_str, flat.tolist()
        else:
            table = self._index
            keys = flat.tolist() if flat.dtype.kind == "S" else [self._key(t) for t in flat.tolist()]
        return np.fromiter((table.get(k, -1) for k in keys), np.int64, len(keys))

    def _read_file(self, path: Any) -> list[Any]:
        return _file_lines(path, self._kind)

    def _oov_of(self, values: np.ndarray) -> np.ndarray:
        if self.num_oov_indices == 1:
            return np.zeros(values.size, np.int64)
        if values.dtype == object:
            values = np.array([self._key(t) for t in values.tolist()], object)
        return np.asarray(to_hash_bucket_fast(values, self.num_oov_indices), np.int64)

    def _as_output(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray([t if t is not None else "" for t in tokens.reshape(-1).tolist()], object).reshape(
            tokens.shape
        )


class IntegerLookup(_Lookup):
    """Keras' ``IntegerLookup``: integers of any range to indices (see the module's
    docstring). Keras' arguments and defaults (``oov_token=-1``); ``oov_method`` sets how
    OOV integers spread over ``num_oov_indices > 1`` (``"floormod"`` or ``"farmhash"``)."""

    _kind = "IntegerLookup"

    def __init__(
        self,
        max_tokens: int | None = None,
        num_oov_indices: int = 1,
        mask_token: int | None = None,
        oov_token: int = -1,
        vocabulary: Any = None,
        vocabulary_dtype: str = "int64",
        idf_weights: Any = None,
        invert: bool = False,
        output_mode: str = "int",
        sparse: bool = False,
        pad_to_max_tokens: bool = False,
        name: str | None = None,
        oov_method: str = "floormod",
    ) -> None:
        if vocabulary_dtype not in ("int64", "int32"):
            raise InvalidArgumentError(
                f"IntegerLookup: vocabulary_dtype must be an integer type, got {vocabulary_dtype!r}"
            )
        if oov_method not in ("floormod", "farmhash"):
            raise InvalidArgumentError(
                f"IntegerLookup: oov_method must be 'floormod' or 'farmhash', got {oov_method!r}"
            )
        self.vocabulary_dtype, self.oov_method, self.name = vocabulary_dtype, oov_method, name
        super().__init__(
            max_tokens,
            num_oov_indices,
            mask_token,
            oov_token,
            vocabulary,
            invert,
            output_mode,
            idf_weights,
            sparse,
            pad_to_max_tokens,
        )

    def _key(self, token: Any) -> int:
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise InvalidArgumentError(f"IntegerLookup takes integers, got {type(token).__name__} {token!r}")
        return int(token)

    def _out(self, key: int) -> int:
        return key

    def _set_tokens(self, keys: list[Any]) -> None:
        super()._set_tokens(keys)
        table = np.array(list(self._index), np.int64)  # (the mask token's too)
        self._order = np.argsort(table, kind="stable")
        self._sorted = table[self._order]
        self._at = np.array(list(self._index.values()), np.int64)[self._order]

    def _indices(self, flat: np.ndarray) -> np.ndarray:
        if flat.dtype.kind not in "iu" or (flat.dtype.kind == "u" and flat.dtype.itemsize == 8):
            return np.fromiter(
                (self._index.get(self._key(t), -1) for t in flat.tolist()), np.int64, flat.size
            )
        if not self._sorted.size:
            return np.full(flat.size, -1, np.int64)
        values = flat.astype(np.int64)
        at = np.minimum(np.searchsorted(self._sorted, values), self._sorted.size - 1)
        return np.where(self._sorted[at] == values, self._at[at], -1)

    def _read_file(self, path: Any) -> list[Any]:
        out = []
        for number, line in enumerate(_file_lines(path, self._kind), 1):
            try:
                out.append(c_int(line))
            except ValueError:
                raise InvalidArgumentError(
                    f"{self._kind}: vocabulary file {path}: line {number} is not an integer: {line!r}"
                ) from None
        return out

    def _oov_of(self, values: np.ndarray) -> np.ndarray:
        if self.num_oov_indices == 1:
            return np.zeros(values.size, np.int64)
        keys = np.array([self._key(t) for t in values.tolist()], np.int64)
        if self.oov_method == "floormod":
            return np.mod(keys, self.num_oov_indices)
        return np.asarray(to_hash_bucket_fast(keys.astype(str), self.num_oov_indices), np.int64)

    def _as_output(self, tokens: np.ndarray) -> np.ndarray:
        return tokens.astype(np.int64)


def _refuse_other_modes(what: str, output_mode: str, sparse: bool) -> None:
    if output_mode != "int":
        raise InvalidArgumentError(
            f"{what}: output_mode {output_mode!r} is not supported here, only 'int' (encode the "
            "bins in the model: one-hot is np.eye(num_bins)[bins])"
        )
    if sparse:
        raise InvalidArgumentError(f"{what}: sparse goes with Keras' other output modes, not supported here")


def _as_strings(values: np.ndarray) -> np.ndarray:
    """What Keras hashes for ``values``: strings as they are, integers as their decimal
    strings, floats cast to integers first."""
    if values.dtype.kind in "USO":
        return values
    if values.dtype.kind == "f":
        values = values.astype(np.int64)
    if values.dtype.kind not in "iub":
        raise InvalidArgumentError(f"Hashing takes strings or numbers, got {values.dtype}")
    return np.array([str(int(v)).encode() for v in values.reshape(-1).tolist()], object).reshape(values.shape)


class Hashing:
    """Keras' ``Hashing``: each value to a bin in ``[0, num_bins)`` (see the module's
    docstring); Keras' arguments (``salt``: an integer, or two)."""

    def __init__(
        self,
        num_bins: int,
        mask_value: Any = None,
        salt: Any = None,
        output_mode: str = "int",
        sparse: bool = False,
        name: str | None = None,
    ) -> None:
        if not isinstance(num_bins, (int, np.integer)) or num_bins <= 0:
            raise InvalidArgumentError(f"Hashing: num_bins must be a positive integer, got {num_bins!r}")
        _refuse_other_modes("Hashing", output_mode, sparse)
        if salt is not None and not (
            isinstance(salt, (int, np.integer)) or (isinstance(salt, (list, tuple)) and len(salt) == 2)
        ):
            raise InvalidArgumentError(f"Hashing: salt must be an integer or two, got {salt!r}")
        self.num_bins, self.mask_value, self.name = int(num_bins), mask_value, name
        self.salt: list[int] | None = None
        if salt is not None:
            self.salt = [int(salt)] * 2 if isinstance(salt, (int, np.integer)) else [int(k) for k in salt]
        self.output_mode, self.sparse = output_mode, sparse

    def __call__(self, inputs: Any) -> np.ndarray:
        values = np.asarray(inputs)
        bins = self.num_bins
        mask = None
        if self.mask_value is not None and bins > 1:
            bins -= 1
            mask = values == self.mask_value
        strings = _as_strings(values)
        if self.salt is not None:
            out = np.asarray(to_hash_bucket_strong(strings, bins, self.salt), np.int64)
        else:
            out = np.asarray(to_hash_bucket_fast(strings, bins), np.int64)
        if mask is not None:
            out = np.where(mask, 0, out + 1)
        return out


#: TensorFlow's key for ``tf.sparse.cross_hashed`` (``hash_key`` not given).
CROSS_KEY = 0xDECAFCAFFE
_MUL = np.uint64(0xC6A4A7935BD1E995)


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> np.uint64(47))


def fingerprint_cat64(fp1: np.ndarray, fp2: np.ndarray) -> np.ndarray:
    """TensorFlow's ``FingerprintCat64``: two 64-bit fingerprints folded into one."""
    with np.errstate(over="ignore"):
        out = fp1 ^ _MUL
        out ^= _shift_mix(fp2 * _MUL) * _MUL
        out *= _MUL
        out = _shift_mix(out) * _MUL
        return _shift_mix(out)


class HashedCrossing:
    """Keras' ``HashedCrossing``: the cross of one value per example of each feature (two or
    more, of one shape: ``()``, ``(batch,)`` or ``(batch, 1)``) to a bin in ``[0, num_bins)``,
    as TensorFlow crosses them (see the module's docstring)."""

    def __init__(
        self, num_bins: int, output_mode: str = "int", sparse: bool = False, name: str | None = None
    ) -> None:
        if not isinstance(num_bins, (int, np.integer)) or num_bins <= 0:
            raise InvalidArgumentError(
                f"HashedCrossing: num_bins must be a positive integer, got {num_bins!r}"
            )
        _refuse_other_modes("HashedCrossing", output_mode, sparse)
        self.num_bins, self.output_mode, self.sparse, self.name = int(num_bins), output_mode, sparse, name

    def __call__(self, inputs: Any) -> np.ndarray:
        if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            raise InvalidArgumentError("HashedCrossing takes a list or tuple of two features or more")
        features = [np.asarray(x) for x in inputs]
        shape = features[0].shape
        if len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
            raise InvalidArgumentError(
                f"HashedCrossing: features must have shape (), (batch,) or (batch, 1), got {shape}"
            )
        if any(f.shape != shape for f in features):
            raise InvalidArgumentError(
                f"HashedCrossing: the features have different shapes {[f.shape for f in features]}"
            )
        out = np.full(features[0].size, CROSS_KEY, np.uint64)
        for f in features:
            flat = f.reshape(-1)
            if flat.dtype.kind in "USO":
                fp = np.asarray(fingerprint64(flat), np.uint64).reshape(-1)
            elif flat.dtype.kind in "iu":
                fp = flat.astype(np.int64).view(np.uint64)
            else:
                raise InvalidArgumentError(f"HashedCrossing crosses strings or integers, got {flat.dtype}")
            out = fingerprint_cat64(out, fp)
        return (out % np.uint64(self.num_bins)).astype(np.int64).reshape(shape)


class Discretization:
    """Keras' ``Discretization``: each number to its bucket, the count of ``bin_boundaries``
    at or below it (``[-inf, b0)`` is 0, ``[b0, b1)`` 1, ...). ``adapt`` sets the boundaries
    of ``num_bins`` buckets of about as many values each, as Keras' does: each batch summed
    up in about ``1 / epsilon`` weighted points, the summaries merged batch by batch, the
    boundaries interpolated on their weights (Keras' numbers, bit for bit)."""

    def __init__(
        self,
        bin_boundaries: Any = None,
        num_bins: int | None = None,
        epsilon: float = 0.01,
        output_mode: str = "int",
        sparse: bool = False,
        dtype: Any = None,
        name: str | None = None,
    ) -> None:
        _refuse_other_modes("Discretization", output_mode, sparse)
        if num_bins is not None and num_bins < 0:
            raise InvalidArgumentError(f"Discretization: num_bins must be 0 or more, got {num_bins}")
        if (num_bins is None) == (bin_boundaries is None):
            raise InvalidArgumentError("Discretization: give bin_boundaries or num_bins (one of them)")
        self.bin_boundaries = None if bin_boundaries is None else [float(b) for b in bin_boundaries]
        self.num_bins, self.epsilon, self.name = num_bins, float(epsilon), name
        self.output_mode, self.sparse = output_mode, sparse
        self._summary = np.zeros((2, 0), np.float32)

    def adapt(self, data: Any, steps: int | None = None) -> None:
        """The boundaries of ``num_bins`` buckets from ``data``: an array, or an iterable of
        batches (a dataset's), the first ``steps`` of them if given."""
        if self.num_bins is None:
            raise InvalidArgumentError(
                "Discretization: a layer made with bin_boundaries cannot adapt; give num_bins instead"
            )
        summary = np.zeros((2, 0), np.float32)
        batches: Iterable[Any] = [data] if isinstance(data, np.ndarray) else data
        for k, batch in enumerate(batches):
            if steps is not None and k >= steps:
                break
            summary = _merged(_summary_of(np.asarray(batch, np.float32), self.epsilon), summary, self.epsilon)
        self._summary = summary
        self.bin_boundaries = _compressed(summary, 1.0 / self.num_bins)[0, :-1].tolist()

    def __call__(self, inputs: Any) -> np.ndarray:
        if self.bin_boundaries is None:
            raise InvalidArgumentError("Discretization: give bin_boundaries, or adapt, before a lookup")
        values = np.asarray(inputs)
        if values.dtype.kind not in "fiub":
            raise InvalidArgumentError(f"Discretization takes numbers, got {values.dtype}")
        return np.searchsorted(np.asarray(self.bin_boundaries), values, side="right").astype(np.int32)


def _summary_of(values: np.ndarray, epsilon: float) -> np.ndarray:
    """A batch as about ``1 / epsilon`` points (every ``step``-th of its sorted values, each
    standing for ``step`` of them): ``[points, weights]``."""
    ordered = np.sort(values.reshape(-1))
    step = max(ordered.size / (1.0 / epsilon), 1)
    points = ordered[int(step - 1) :: int(step)]
    return np.stack([points, np.ones_like(points) * step])


def _merged(first: np.ndarray, second: np.ndarray, epsilon: float) -> np.ndarray:
    both = np.concatenate((first, second), axis=1)
    return _compressed(np.take(both, np.argsort(both[0]), axis=1), epsilon)


def _compressed(summary: np.ndarray, epsilon: float) -> np.ndarray:
    """``summary`` as at most about ``1 / epsilon`` points, interpolated on the cumulative
    share of its weights (unchanged if it is that small already)."""
    if summary.shape[1] * epsilon < 1:
        return summary
    shares = epsilon + np.arange(0.0, 1.0, epsilon)
    cumulative = summary[1].cumsum()
    at = cumulative / cumulative[-1]
    points = np.interp(shares, at, summary[0])
    cumulative = np.interp(shares, at, cumulative)
    weights = cumulative - np.concatenate((np.array([0]), cumulative[:-1]))
    return np.stack((points, weights)).astype(np.float32)


expose(globals(), "pstrain.data")
