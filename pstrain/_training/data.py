"""``pstrain.data``: a small, numpy-native input pipeline in the shape of ``tf.data``.

``Dataset.from_tensor_slices(arrays)``, ``from_tensors``, ``range``, ``random``,
``from_generator``, ``zip``, ``sample_from_datasets``, ``choose_from_datasets``, then
``map``, ``filter``, ``shuffle(buffer_size, seed)``, ``repeat``, ``batch``,
``padded_batch``, ``ragged_batch``, ``sparse_batch``, ``unbatch``, ``take``, ``take_while``,
``skip``, ``shard``, ``enumerate``, ``scan``, ``unique``, ``concatenate``, ``flat_map``,
``interleave``, ``cache`` (in memory), ``apply``, ``ignore_errors`` (after ``map`` and
``filter`` steps) and ``prefetch`` (and ``reduce``), each as ``tf.data`` defines it, and
``cardinality()`` (``len``) as TF counts it. Elements stay numpy; tuples and dicts of arrays
batch component-wise. Iterating a dataset again starts it again.

Pipelines built from ``from_tensor_slices`` work on *row indices* until a
``map``, ``filter`` or ``batch`` (``shard``, ``shuffle``, ``repeat``, ``take`` and ``skip``
keep them): shuffling and repeating move arrays of them, a block at a
time (``row_indices.py``), and ``batch`` gathers each batch with one call per
array, so a training step's input costs no Python loop over its examples.

``shuffle`` without a seed draws fresh randomness per iterator, so two workers
shuffle differently; with a seed, every worker gets the same order (and each
epoch of a repeated dataset a different, reproducible one).

>>> ds = Dataset.from_tensor_slices((np.arange(6), np.arange(6) * 10)).batch(4)
>>> [tuple(x.tolist() for x in b) for b in ds]
[([0, 1, 2, 3], [0, 10, 20, 30]), ([4, 5], [40, 50])]
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._base.checks import whole
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from . import row_indices
from .elements import (
    OneStructure,
    first_dimension,
    leaves_len,
    padded,
    ragged,
    rows_of,
    sparse,
    stack,
    structure_of,
    take,
    to_arrays,
    unique_key,
)
from .row_indices import Blocks
from .specs import TensorSpec, conforming, signature, spec_of

logger = logging.getLogger("pstrain.data")

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset", "Options", "TensorSpec"]

#: ``prefetch(AUTOTUNE)``, as ``tf.data.AUTOTUNE``: a buffer of 1 here.
AUTOTUNE = -1
#: ``Dataset.cardinality()`` of a dataset without end (``repeat()``), as TF's.
INFINITE_CARDINALITY = -1
#: ``Dataset.cardinality()`` of a dataset whose length is known only by iterating it
#: (``from_generator``, ``filter``, ``flat_map``, ``unbatch``), as TF's.
UNKNOWN_CARDINALITY = -2


def _datasets(datasets: Any, what: str) -> list[Dataset]:
    parts = list(datasets) if isinstance(datasets, (list, tuple)) else None
    if not parts or not all(isinstance(d, Dataset) for d in parts):
        raise InvalidArgumentError(f"{what} takes a non-empty list of Datasets, got {datasets!r}"[:200])
    return parts


def _truth(value: Any, what: str = "filter") -> bool:
    """A ``filter`` predicate's answer: a scalar bool (numpy's or Python's)."""
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype != np.bool_:
        raise InvalidArgumentError(
            f"{what}: the predicate must return a scalar bool, got {type(value).__name__} "
            f"of dtype {arr.dtype} and shape {arr.shape}"
        )
    return bool(arr)


#: The end of an iterator, to ``next(it, _END)``.
_END = object()


def _returned_dataset(map_func: Callable[..., Any], e: Any, what: str) -> Dataset:
    inner = map_func(*e) if isinstance(e, tuple) else map_func(e)
    if not isinstance(inner, Dataset):
        raise InvalidArgumentError(f"{what}: the function must return a Dataset, got {type(inner).__name__}")
    return inner


def _batch_count(n: int, size: int, drop_remainder: bool) -> int:
    """The cardinality of ``n`` elements in batches of ``size`` (TF's)."""
    return n if n < 0 else n // size + (0 if n % size == 0 or drop_remainder else 1)


def _parallel_calls(n: Any, what: str) -> None:
    if n is not None:
        whole(n, f"{what} num_parallel_calls (AUTOTUNE is -1)", AUTOTUNE)
        if n == 0:
            raise InvalidArgumentError(f"{what} num_parallel_calls must be AUTOTUNE (-1) or 1 or more, got 0")


def _flatten_datasets(nest: Any, out: list[Dataset]) -> None:
    """The datasets of a (nested) tuple or dict of them, in order, into ``out``."""
    if isinstance(nest, Dataset):
        out.append(nest)
    elif isinstance(nest, dict):
        for v in nest.values():
            _flatten_datasets(v, out)
    elif isinstance(nest, tuple):
        for v in nest:
            _flatten_datasets(v, out)
    else:
        raise InvalidArgumentError(f"not a Dataset: {type(nest).__name__}")


def _packed(nest: Any, values: Iterator[Any]) -> Any:
    """``values`` (one per dataset of ``nest``, in order) in ``nest``'s structure."""
    if isinstance(nest, Dataset):
        return next(values)
    if isinstance(nest, dict):
        return {k: _packed(v, values) for k, v in nest.items()}
    return tuple(_packed(v, values) for v in nest)


def _callable(fn: Any, what: str) -> None:
    if not callable(fn):
        raise InvalidArgumentError(f"{what} takes a function, got {type(fn).__name__}")


def _window_of(elements: list[Any]) -> Any:
    """A window's elements as a dataset, or as a tuple or dict of datasets of the
    components (TF's windows of structured elements)."""
    first = elements[0]
    if isinstance(first, tuple):
        return tuple(_window_of([e[i] for e in elements]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _window_of([e[k] for e in elements]) for k in first}
    items = list(elements)
    return Dataset(lambda: iter(items), cardinality=len(items))


def _first_axis_shapes(element: Any, fill: int) -> Any:
    """``padded_shapes`` for ``element``: each array component's first axis ``fill`` long,
    the rest to the longest in the batch (``bucket_by_sequence_length`` to the boundary)."""
    if isinstance(element, tuple):
        return tuple(_first_axis_shapes(e, fill) for e in element)
    if isinstance(element, dict):
        return {k: _first_axis_shapes(v, fill) for k, v in element.items()}
    ndim = np.ndim(element)
    return [fill] + [None] * (ndim - 1) if ndim else []


class Options:
    """TF's ``tf.data.Options``: any option, in any group (``options.experimental_distribute.
    auto_shard_policy = ...``), set and read back; :meth:`Dataset.with_options` keeps them.
    None is applied: a per-worker dataset of the parameter-server strategy ignores its
    options in TF too."""

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name not in values:
            values[name] = Options()  # a group, made when first named
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_values")[name] = value

    def __repr__(self) -> str:
        return f"Options({object.__getattribute__(self, '_values')})"


class Dataset:
    """An iterable pipeline; every ``iter()`` starts from the beginning."""

    def __init__(
        self,
        make: Callable[[], Iterator[Any]],
        *,
        source: Any = None,
        indices: Blocks | None = None,
        spec: Any = None,
        partial_batch: bool = False,
        cardinality: int = UNKNOWN_CARDINALITY,
        rows: int | None = None,
    ) -> None:
        self._make = make
        self._source = source  # slices mode: the arrays...
        self._indices = indices  # ...and its rows, in blocks (``row_indices.py``)
        self._spec = spec  # a declared element_spec (from_generator's signature)
        self._partial_batch = partial_batch  # batched without drop_remainder
        self._cardinality = cardinality  # its elements, as TF counts them
        self._rows = rows  # every element's first dimension, if known without iterating
        # a dataset ending in map and filter steps: the dataset before them, and each step
        # (``ignore_errors`` runs them again, an element at a time, dropping those that raise)
        self._steps: tuple[Dataset, tuple[tuple[str, Callable[..., Any]], ...]] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self._make()

    def cardinality(self) -> np.int64:
        """How many elements it has, as TF counts them without iterating:
        ``INFINITE_CARDINALITY`` (-1) after ``repeat()``, ``UNKNOWN_CARDINALITY`` (-2)
        where only iterating would tell (``from_generator``, ``filter`` ...)."""
        return np.int64(self._cardinality)

    def __len__(self) -> int:
        """The cardinality; a ``TypeError`` for an infinite or unknown one, as TF's."""
        if self._cardinality == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if self._cardinality == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return self._cardinality

    def __bool__(self) -> bool:  # (``len`` must not decide it: a dataset object is always true)
        return True

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` (or tuple/dict of them) of this dataset's elements.

        Declared by ``from_generator(output_signature=...)``; otherwise read from the first
        element, with the batch dimension ``None`` after ``batch(drop_remainder=False)``.
        """
        if self._spec is not None:
            return self._spec
        for element in self:
            return spec_of(element, self._partial_batch)
        raise InvalidArgumentError(
            "element_spec of an empty dataset is unknown here: "
            "declare it with from_generator(output_signature=...)"
        )

    # -- sources -------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """Elements are the rows of ``tensors`` (an array, or a tuple or dict of them). A
        :class:`~pstrain.JaggedTensor` or :class:`~pstrain.KeyedJaggedTensor` component has
        a bag (of ids, per feature) per row; an element holds it as a batch of one, and
        ``batch`` joins the bags (variable-length features batch, shuffle and shard as the
        arrays beside them). A 2-D ``SparseTensor`` or a ``RaggedTensor`` (pstrain's or
        TF's) is sliced as the :class:`~pstrain.JaggedTensor` of its rows."""
        source = to_arrays(tensors, sliced=True)
        n = leaves_len(source)
        return Dataset._slices(source, row_indices.rows(n), n)

    @staticmethod
    def _slices(source: Any, indices: Blocks, cardinality: int) -> Dataset:
        return Dataset(
            lambda: (take(source, i) for i in row_indices.each(indices)),
            source=source,
            indices=indices,
            cardinality=cardinality,
            rows=first_dimension(source, sliced=True),
        )

    @staticmethod
    def range(*args: int, output_type: Any = np.int64, name: str | None = None) -> Dataset:
        """Like Python's ``range``, as scalars of ``output_type`` (int64, as TF's)."""
        kind = np.dtype(output_type)
        if kind.kind not in "iuf":
            raise InvalidArgumentError(f"range: output_type must be a numeric dtype, got {kind}")
        r = range(*args)
        return Dataset(lambda: (kind.type(i) for i in r), cardinality=len(r))

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: Any = np.int64, name: str | None = None) -> Dataset:
        """``start``, ``start + step``, ... without end, as scalars of ``dtype`` (TF's)."""
        kind = np.dtype(dtype)
        if kind.kind not in "iuf":
            raise InvalidArgumentError(f"counter: dtype must be a numeric dtype, got {kind}")
        return Dataset(
            lambda: (kind.type(i) for i in itertools.count(start, step)), cardinality=INFINITE_CARDINALITY
        )

    @staticmethod
    def random(
        seed: int | None = None, rerandomize_each_iteration: bool | None = None, name: str | None = None
    ) -> Dataset:
        """Random int64 scalars from 0 below 2**32, without end, as TF's (from another generator:
        not TF's numbers). Every iteration gives the same numbers, from ``seed`` or, without
        one, from a seed drawn when the dataset is made (each worker's ``dataset_fn`` draws its
        own), unless ``rerandomize_each_iteration``: then each iteration its own, reproducible
        from ``seed``. ``name`` is TF's, accepted."""
        base = secrets.randbits(63) if seed is None else whole(seed, "random: seed", 0)
        iterations = itertools.count()

        def run() -> Iterator[Any]:
            rng = np.random.default_rng([base, next(iterations) if rerandomize_each_iteration else 0])
            while True:
                yield from rng.integers(0, 2**32, 1024, dtype=np.int64)

        return Dataset(run, cardinality=INFINITE_CARDINALITY)

    @staticmethod
    def list_files(
        file_pattern: Any, shuffle: bool | None = None, seed: int | None = None, name: str | None = None
    ) -> Dataset:
        """The files matching ``file_pattern`` (a glob, or a list of them), as bytes, as
        TF's: shuffled on each iteration unless ``shuffle=False`` (then in sorted order);
        ``seed`` makes the shuffles repeat. No file matching a pattern is an error naming it."""
        patterns = (
            [file_pattern] if isinstance(file_pattern, (str, bytes, os.PathLike)) else list(file_pattern)
        )
        names: list[bytes] = []
        for pattern in patterns:
            found = sorted(glob.glob(os.fsdecode(pattern)))
            if not found:
                raise InvalidArgumentError(f"list_files: No files matched pattern: {os.fsdecode(pattern)}")
            names += [os.fsencode(f) for f in found]
        names = sorted(set(names))
        mix = shuffle is None or bool(shuffle)
        rng = np.random.default_rng(seed)

        def run() -> Iterator[bytes]:
            order = rng.permutation(len(names)) if mix else range(len(names))
            return (names[i] for i in order)

        return Dataset(run, cardinality=len(names))

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """One element: ``tensors`` (an array, or a tuple or dict of them) whole."""
        element = to_arrays(tensors)
        return Dataset(lambda: iter((element,)), cardinality=1, rows=first_dimension(element, sliced=False))

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple[Any, ...] | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Elements produced by ``generator(*args)`` (called anew for each iteration). Each
        element is checked against ``output_signature`` (``TensorSpec``s in the element's
        structure; or TF's older ``output_types`` and ``output_shapes``) and refused, naming
        what differs, as TF refuses it."""
        if not callable(generator):
            raise InvalidArgumentError("from_generator takes a callable that returns an iterator")
        if output_signature is not None and (output_types is not None or output_shapes is not None):
            raise InvalidArgumentError(
                "from_generator: give output_signature, or output_types (and output_shapes), not both"
            )
        if output_signature is None and output_types is not None:
            output_signature = signature(output_types, output_shapes)
        call_args = tuple(args or ())
        if output_signature is None:
            return Dataset(lambda: iter(generator(*call_args)))

        def run() -> Iterator[Any]:
            for element in generator(*call_args):
                yield conforming(element, output_signature)

        return Dataset(run, spec=output_signature)

    # -- transformations -----------------------------------------------------------------------
    def _same_elements(self, make: Callable[[], Iterator[Any]], cardinality: int | None = None) -> Dataset:
        """A dataset of elements as this one's (their spec and first dimension), made by
        ``make``; as many as this one's unless ``cardinality`` says otherwise."""
        return Dataset(
            make,
            spec=self._spec,
            partial_batch=self._partial_batch,
            cardinality=self._cardinality if cardinality is None else cardinality,
            rows=self._rows,
        )

    def _derive(
        self,
        index_op: Callable[[Blocks], Blocks] | None,
        elem_op: Callable[[Callable[[], Iterator[Any]]], Callable[[], Iterator[Any]]],
        cardinality: int,
    ) -> Dataset:
        if self._indices is not None and index_op is not None:
            return Dataset._slices(self._source, index_op(self._indices), cardinality)
        return self._same_elements(elem_op(self._make), cardinality)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        synchronous: bool | None = None,
        use_unbounded_threadpool: bool = False,
        name: str | None = None,
    ) -> Dataset:
        """Apply ``map_func`` to each element (a tuple element is passed as arguments).
        ``num_parallel_calls`` (``AUTOTUNE`` ...), ``deterministic``, ``synchronous``,
        ``use_unbounded_threadpool`` and ``name`` are TF's, accepted: the calls run one after
        another, in order (a worker's closures and its ``prefetch`` thread already share its
        cores)."""
        _callable(map_func, "map")
        _parallel_calls(num_parallel_calls, "map")
        make = self._make

        def run() -> Iterator[Any]:
            for e in make():
                yield map_func(*e) if isinstance(e, tuple) else map_func(e)

        return self._stepped("map", map_func, Dataset(run, cardinality=self._cardinality))

    def _stepped(self, kind: str, fn: Callable[..., Any], out: Dataset) -> Dataset:
        """``out``, this dataset's ``map`` or ``filter`` by ``fn``, knowing its steps."""
        base, steps = self._steps if self._steps is not None else (self, ())
        out._steps = (base, (*steps, (kind, fn)))
        return out

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """TF's buffer shuffle: keep ``buffer_size`` elements, emit a random one, refill."""
        whole(buffer_size, "shuffle buffer_size", 1)
        epochs = itertools.count()

        def rng() -> np.random.Generator:
            if seed is None:
                return np.random.default_rng()
            return np.random.default_rng([seed, next(epochs) if reshuffle_each_iteration else 0])

        def shuffled(make: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
            def run() -> Iterator[Any]:
                r = rng()
                it = make()
                buf = list(itertools.islice(it, buffer_size))
                draws: Iterator[float] = iter(())
                for x in it:
                    j = next(draws, None)
                    if j is None:
                        draws = iter(r.random(1024).tolist())
                        j = next(draws)
                    k = int(j * len(buf))
                    yield buf[k]
                    buf[k] = x
                order = r.permutation(len(buf))
                for k in order:
                    yield buf[k]

            return run

        return self._derive(
            lambda blocks: row_indices.shuffled(blocks, buffer_size, rng), shuffled, self._cardinality
        )

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat ``count`` times (forever when None); each pass re-iterates the input."""
        if count is not None:
            whole(count, "repeat count")

        def repeated(make: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
            def run() -> Iterator[Any]:
                passes = itertools.count() if count is None or count < 0 else range(count)
                for _ in passes:
                    empty = True
                    for x in make():
                        empty = False
                        yield x
                    if empty:
                        return

            return run

        n = self._cardinality
        if count is None or count < 0:
            times = 0 if n == 0 else INFINITE_CARDINALITY
        else:
            times = 0 if count == 0 else n if n < 0 else n * count
        return self._derive(lambda blocks: row_indices.repeated(blocks, count), repeated, times)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all when negative)."""
        whole(count, "take count")

        def taken(make: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
            return lambda: make() if count < 0 else itertools.islice(make(), count)

        n = self._cardinality
        if n == UNKNOWN_CARDINALITY or count < 0:
            kept = n
        else:
            kept = count if n == INFINITE_CARDINALITY else min(n, count)
        return self._derive(lambda blocks: row_indices.taken(blocks, count), taken, kept)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``."""
        if not 0 <= whole(index, "shard index") < whole(num_shards, "num_shards", 1):
            raise InvalidArgumentError(f"shard index {index} out of range for {num_shards} shards")

        def sharded(make: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
            return lambda: itertools.islice(make(), index, None, num_shards)

        n = self._cardinality
        share = n if n < 0 else n // num_shards + (1 if index < n % num_shards else 0)
        return self._derive(lambda blocks: row_indices.sharded(blocks, num_shards, index), sharded, share)

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Stack ``batch_size`` consecutive elements (component-wise for tuples and dicts).
        ``num_parallel_calls``, ``deterministic`` and ``name`` are TF's, accepted (as ``map``)."""
        whole(batch_size, "batch_size", 1)
        _parallel_calls(num_parallel_calls, "batch")
        if self._indices is not None:
            source = self._source
            batch_rows = row_indices.batches(self._indices, batch_size, drop_remainder)

            def gather() -> Iterator[Any]:
                for idx in batch_rows():
                    yield take(source, idx)

            return Dataset(
                gather,
                partial_batch=not drop_remainder,
                cardinality=_batch_count(self._cardinality, batch_size, drop_remainder),
                rows=batch_size if drop_remainder else None,
            )
        return self._chunked(batch_size, drop_remainder, stack)

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset:
        """``batch_size`` consecutive elements stacked, each array component padded at the
        end of each dimension to ``padded_shapes`` (None, or None / -1 in a shape: the
        longest in the batch) with ``padding_values`` (None: 0, False or "" by dtype), as
        TF's. Bags of ids batch without padding: ``batch`` (``JaggedTensor``)."""
        whole(batch_size, "batch_size", 1)
        return self._chunked(
            batch_size, drop_remainder, lambda chunk: padded(chunk, padded_shapes, padding_values)
        )

    def ragged_batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        row_splits_dtype: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """``batch``, with components whose elements differ in length batched as bags of ids
        (a :class:`~pstrain.JaggedTensor`), as TF's ``ragged_batch`` makes them ragged. Which
        components: with a declared ``element_spec`` (``from_generator``'s signature), those
        of shape ``(None,)``, as TF; without one, every 1-D integer component (a feature's ids,
        however many). Other components batch as ``batch`` does; elements of other shapes
        that differ are refused (a JaggedTensor holds ids: ``padded_batch`` pads the rest).
        ``row_splits_dtype`` and ``name`` are TF's, accepted (the offsets are int64)."""
        whole(batch_size, "batch_size", 1)
        spec = self._spec
        return self._chunked(batch_size, drop_remainder, lambda chunk: ragged(chunk, spec))

    def sparse_batch(self, batch_size: int, row_shape: Any, name: str | None = None) -> Dataset:
        """``batch_size`` consecutive elements (one array each, of ``row_shape``'s rank and no
        larger in any dimension) as one :class:`~pstrain.SparseTensor` of every entry, of
        ``dense_shape`` ``[batch, *row_shape]`` (None in ``row_shape``: the batch's largest),
        as TF's (and ``tf.data.experimental.dense_to_sparse_batch``): what
        ``embedding_lookup_sparse`` takes. ``name`` is TF's, accepted."""
        whole(batch_size, "batch_size", 1)
        if row_shape is None:
            raise InvalidArgumentError(
                "sparse_batch: row_shape must be a shape (None in it: the batch's largest)"
            )
        shape = tuple(
            None if d is None else whole(d, f"sparse_batch: row_shape {row_shape!r}: a size", 0)
            for d in np.asarray(row_shape, object).reshape(-1)
        )
        return self._chunked(batch_size, False, lambda chunk: sparse(chunk, shape))

    def _chunked(self, size: int, drop_remainder: bool, combine: Callable[[list[Any]], Any]) -> Dataset:
        """Batches of ``size`` consecutive elements, each made by ``combine`` (element by
        element: ``batch`` after a ``map``, ``padded_batch``)."""
        make = self._make

        def run() -> Iterator[Any]:
            it = make()
            while True:
                chunk = list(itertools.islice(it, size))
                if not chunk or (drop_remainder and len(chunk) < size):
                    return
                yield combine(chunk)

        count = _batch_count(self._cardinality, size, drop_remainder)
        return Dataset(
            run, partial_batch=not drop_remainder, cardinality=count, rows=size if drop_remainder else None
        )

    def interleave(
        self,
        map_func: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """The elements of the datasets ``map_func`` returns, ``cycle_length`` of them open
        at once, ``block_length`` elements from each in turn (TF's order; ``cycle_length``
        None or ``AUTOTUNE``: this machine's cores, as TF's). ``num_parallel_calls`` is
        accepted: one dataset is read at a time."""
        _callable(map_func, "interleave")
        _parallel_calls(num_parallel_calls, "interleave")
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = len(os.sched_getaffinity(0))
        whole(cycle_length, "interleave cycle_length", 1)
        block = 1 if block_length is None else whole(block_length, "interleave block_length", 1)
        make = self._make

        def run() -> Iterator[Any]:
            inputs = make()
            slots: list[Iterator[Any] | None] = [None] * cycle_length
            opened, at, taken, ended = 0, 0, 0, False
            while not ended or opened:
                current = slots[at]
                if current is not None:
                    x = next(current, _END)
                    if x is not _END:
                        taken += 1
                        if taken == block:
                            at, taken = (at + 1) % cycle_length, 0
                        yield x
                        continue
                    slots[at], opened = None, opened - 1
                    at, taken = (at + 1) % cycle_length, 0
                elif not ended:
                    e = next(inputs, _END)
                    if e is _END:
                        ended = True
                    else:
                        slots[at], opened = iter(_returned_dataset(map_func, e, "interleave")), opened + 1
                else:
                    at, taken = (at + 1) % cycle_length, 0

        return Dataset(run)

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """``reduce_func(state, element)`` over every element, from ``initial_state``: the
        final state (TF's ``reduce``, run here)."""
        _callable(reduce_func, "reduce")
        state = initial_state
        for e in self:
            state = reduce_func(state, e)
        return state

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none when ``count`` is -1, as TF's)."""
        whole(count, "skip count", -1)

        def skipped(make: Callable[[], Iterator[Any]]) -> Callable[[], Iterator[Any]]:
            return lambda: itertools.islice(make(), count, None) if count >= 0 else iter(())

        n = self._cardinality
        left = n if n < 0 else 0 if count < 0 else max(0, n - count)
        return self._derive(lambda blocks: row_indices.skipped(blocks, count), skipped, left)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which ``predicate`` (given a tuple element as arguments, as
        ``map``) returns True: a scalar bool, as TF requires."""
        _callable(predicate, "filter")
        make = self._make

        def run() -> Iterator[Any]:
            for e in make():
                if _truth(predicate(*e) if isinstance(e, tuple) else predicate(e)):
                    yield e

        return self._stepped(
            "filter", predicate, Dataset(run, spec=self._spec, partial_batch=self._partial_batch)
        )

    def ignore_errors(self, log_warning: bool = False, name: str | None = None) -> Dataset:
        """The elements, without those whose ``map`` or ``filter`` function raised (in the
        steps of them this dataset ends in), as TF's drops elements that cause errors;
        ``log_warning``: the ``pstrain.data`` log names each error. Errors of the other steps
        (the file or generator the elements come from, a batch) still raise: put it right
        after the ``map`` that may fail (a dataset ending in no such step is refused). A
        predicate that returns no bool is still an error. ``name`` is TF's, accepted."""
        if self._steps is None:
            raise InvalidArgumentError(
                "ignore_errors drops the elements whose map or filter function raised, and this "
                "dataset does not end in a map or filter: put it right after the map that may "
                "fail (errors of other steps are not dropped)"
            )
        base, steps = self._steps
        make = base._make  # noqa: SLF001 - this class's own

        def run() -> Iterator[Any]:
            for e in make():
                kept = True
                for kind, fn in steps:
                    try:
                        got = fn(*e) if isinstance(e, tuple) else fn(e)
                    except Exception as exc:  # (what the element caused, as TF's drops it)
                        if log_warning:
                            logger.warning(
                                "ignore_errors: dropped an element: %s: %s", type(exc).__name__, exc
                            )
                        kept = False
                        break
                    if kind == "map":
                        e = got
                    elif not _truth(got):
                        kept = False
                        break
                if kept:
                    yield e

        return Dataset(run)

    def take_while(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset:
        """The elements up to the first for which ``predicate`` returns False (a scalar
        bool, as ``filter``)."""
        _callable(predicate, "take_while")
        make = self._make

        def run() -> Iterator[Any]:
            for e in make():
                if not _truth(predicate(*e) if isinstance(e, tuple) else predicate(e), "take_while"):
                    return
                yield e

        return Dataset(run, spec=self._spec, partial_batch=self._partial_batch)

    def scan(
        self, initial_state: Any, scan_func: Callable[[Any, Any], Any], name: str | None = None
    ) -> Dataset:
        """TF's ``scan``: ``scan_func(state, element)`` returns ``(new_state, output)``; the
        outputs are the elements, the state carried from one to the next."""
        _callable(scan_func, "scan")
        make = self._make

        def run() -> Iterator[Any]:
            state = initial_state
            for e in make():
                got = scan_func(state, e)
                if not isinstance(got, tuple) or len(got) != 2:
                    raise InvalidArgumentError(
                        f"scan: scan_func must return (new_state, output), got {type(got).__name__}"
                    )
                state, out = got
                yield out

        return Dataset(run, cardinality=self._cardinality)

    def unique(self, name: str | None = None) -> Dataset:
        """Each distinct element once, in the order first seen: elements of one component,
        integers or strings of any shape (equal in shape and values), as TF's."""
        make = self._make

        def run() -> Iterator[Any]:
            seen: set[Any] = set()
            for e in make():
                key = unique_key(e)
                if key not in seen:
                    seen.add(key)
                    yield e

        return Dataset(run, spec=self._spec)

    @staticmethod
    def sample_from_datasets(
        datasets: list[Dataset],
        weights: Any = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset:
        """Each element from one of ``datasets`` drawn at random by ``weights`` (even by
        default); a dataset that runs out is left out of the draws (the weights of the
        others renormalized), or ends it with ``stop_on_empty_dataset``, as TF's."""
        parts = _datasets(datasets, "sample_from_datasets")
        w = np.full(len(parts), 1.0 / len(parts)) if weights is None else np.asarray(weights, np.float64)
        if w.shape != (len(parts),) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise InvalidArgumentError(
                f"sample_from_datasets: weights must be {len(parts)} numbers of 0 or more, "
                f"not all 0; got {weights!r}"
            )

        def run() -> Iterator[Any]:
            rng = np.random.default_rng(seed)
            its = [iter(d) for d in parts]
            live = w.copy()
            same = OneStructure("sample_from_datasets", len(parts))
            while live.sum() > 0:
                k = int(rng.choice(len(its), p=live / live.sum()))
                e = next(its[k], _END)
                if e is _END:
                    if stop_on_empty_dataset:
                        return
                    live[k] = 0.0
                    continue
                same.check(k, e)
                yield e

        return Dataset(run)

    @staticmethod
    def choose_from_datasets(
        datasets: list[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
    ) -> Dataset:
        """Each element from ``datasets[c]``, ``c`` the next element of ``choice_dataset``
        (int64 scalars); with ``stop_on_empty_dataset`` (TF's default) a chosen dataset
        that has run out ends it, otherwise that choice is skipped."""
        parts = _datasets(datasets, "choose_from_datasets")
        if not isinstance(choice_dataset, Dataset):
            raise InvalidArgumentError(
                f"choose_from_datasets: choice_dataset must be a Dataset, got {type(choice_dataset).__name__}"
            )

        def run() -> Iterator[Any]:
            its = [iter(d) for d in parts]
            same = OneStructure("choose_from_datasets", len(parts))
            for c in choice_dataset:
                arr = np.asarray(c)
                if arr.ndim != 0 or arr.dtype.kind not in "iu" or not 0 <= int(arr) < len(its):
                    raise InvalidArgumentError(
                        "choose_from_datasets: a choice must be an integer scalar in "
                        f"[0, {len(its)}), got {c!r}"
                    )
                e = next(its[int(arr)], _END)
                if e is _END:
                    if stop_on_empty_dataset:
                        return
                    continue
                same.check(int(arr), e)
                yield e

        return Dataset(run)

    def enumerate(self, start: int = 0) -> Dataset:
        """``(index, element)`` pairs, the index an int64 from ``start``."""
        whole(start, "enumerate start")
        make = self._make
        return Dataset(
            lambda: ((np.int64(i), e) for i, e in enumerate(make(), start)), cardinality=self._cardinality
        )

    def rebatch(self, batch_size: int, drop_remainder: bool = False, name: str | None = None) -> Dataset:
        """The elements of the batches again in batches of ``batch_size`` (TF's: ``unbatch``
        then ``batch``; its cardinality unknown, as TF's)."""
        out = self.unbatch().batch(batch_size, drop_remainder=drop_remainder)
        out._cardinality = UNKNOWN_CARDINALITY  # noqa: SLF001 - this class's own
        return out

    def window(
        self,
        size: int,
        shift: int | None = None,
        stride: int = 1,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset:
        """Windows of ``size`` elements, each a dataset (a tuple or dict of datasets, one per
        component, for elements of several), as TF's: a window starts every ``shift``
        elements (default ``size``) and takes every ``stride``-th from there; the last ones
        are shorter unless ``drop_remainder``."""
        size = whole(size, "window size", 1)
        shift = size if shift is None else whole(shift, "window shift", 1)
        stride = whole(stride, "window stride", 1)
        span = (size - 1) * stride + 1  # the elements a whole window covers
        make = self._make

        def windows() -> Iterator[Any]:
            buffer: list[Any] = []  # from the next window's start on
            it = make()
            ended = False
            while True:
                while not ended and len(buffer) < span:
                    e = next(it, _END)
                    if e is _END:
                        ended = True
                    else:
                        buffer.append(e)
                if not buffer or (ended and drop_remainder and len(buffer) < span):
                    return
                yield _window_of(buffer[:span:stride])
                if ended and len(buffer) <= shift:
                    return
                have = len(buffer)
                del buffer[: min(shift, have)]
                for _ in range(shift - have):  # the next window starts past what was read
                    if ended or next(it, _END) is _END:
                        return

        return Dataset(windows)

    def group_by_window(
        self,
        key_func: Callable[..., Any],
        reduce_func: Callable[[Any, Dataset], Dataset],
        window_size: int | None = None,
        window_size_func: Callable[[Any], int] | None = None,
        name: str | None = None,
    ) -> Dataset:
        """TF's: elements grouped by ``key_func`` (an integer per element); a group of
        ``window_size`` (or ``window_size_func(key)``) elements becomes the elements of
        ``reduce_func(key, dataset of them)`` as it fills; at the end the groups left, by
        ascending key (TF's order)."""
        _callable(key_func, "group_by_window key_func")
        _callable(reduce_func, "group_by_window reduce_func")
        if (window_size is None) == (window_size_func is None):
            raise InvalidArgumentError("group_by_window: give window_size or window_size_func (one of them)")
        size_of: Callable[[Any], int] = (
            (lambda key: window_size) if window_size_func is None else window_size_func  # type: ignore[assignment,return-value]
        )
        make = self._make

        def call(fn: Callable[..., Any], e: Any) -> Any:
            return fn(*e) if isinstance(e, tuple) else fn(e)

        def reduced(key: int, items: list[Any]) -> Iterator[Any]:
            window = Dataset(lambda: iter(items), cardinality=len(items))
            out = reduce_func(np.int64(key), window)
            if not isinstance(out, Dataset):
                raise InvalidArgumentError(
                    f"group_by_window: reduce_func must return a Dataset, got {type(out).__name__}"
                )
            return iter(out)

        def run() -> Iterator[Any]:
            groups: dict[int, list[Any]] = {}
            for e in make():
                raw = np.asarray(call(key_func, e))
                if raw.ndim != 0 or raw.dtype.kind not in "iu":
                    raise InvalidArgumentError(f"group_by_window: key_func must give an integer, got {raw!r}")
                key = int(raw)
                group = groups.setdefault(key, [])
                group.append(e)
                size = whole(size_of(np.int64(key)), "group_by_window window size", 1)
                if len(group) >= size:
                    del groups[key]
                    yield from reduced(key, group)
            for key in sorted(groups):
                yield from reduced(key, groups[key])

        return Dataset(run)

    def bucket_by_sequence_length(
        self,
        element_length_func: Callable[..., Any],
        bucket_boundaries: list[int],
        bucket_batch_sizes: list[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        no_padding: bool = False,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset:
        """TF's: elements batched with others of their length bucket (``bucket_boundaries``
        ascending; bucket ``i`` holds lengths in ``[boundaries[i - 1], boundaries[i])``), a
        batch of ``bucket_batch_sizes[i]`` each (one more size than boundaries), padded to
        the longest in the batch (``pad_to_bucket_boundary``: to the bucket's boundary less
        one along each component's first axis; ``no_padding``: ``batch``)."""
        bounds = [whole(b, "bucket boundary", 1) for b in bucket_boundaries]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise InvalidArgumentError(f"bucket_by_sequence_length: boundaries must ascend, got {bounds}")
        sizes = [whole(b, "bucket batch size", 1) for b in bucket_batch_sizes]
        if len(sizes) != len(bounds) + 1:
            raise InvalidArgumentError(
                f"bucket_by_sequence_length: len(bucket_batch_sizes) must equal len(bucket_boundaries) + 1, "
                f"got {len(sizes)} and {len(bounds)}"
            )

        def bucket_of(*e: Any) -> np.int64:
            length = int(np.asarray(element_length_func(*e)))
            if pad_to_bucket_boundary and length >= bounds[-1]:
                raise InvalidArgumentError(
                    "bucket_by_sequence_length: When pad_to_bucket_boundary=True, elements must have "
                    f"length < max(bucket_boundaries), got {length}"
                )
            return np.int64(sum(length >= b for b in bounds))

        def batched(bucket: Any, window: Dataset) -> Dataset:
            size = sizes[int(bucket)]
            if no_padding:
                return window.batch(size, drop_remainder=drop_remainder)
            shapes = padded_shapes
            if pad_to_bucket_boundary and shapes is None:
                fill = bounds[int(bucket)] - 1
                shapes = _first_axis_shapes(next(iter(window)), fill)
            return window.padded_batch(size, shapes, padding_values, drop_remainder=drop_remainder)

        return self.group_by_window(bucket_of, batched, window_size_func=lambda bucket: sizes[int(bucket)])

    def get_single_element(self, name: str | None = None) -> Any:
        """The dataset's only element (TF's): an empty one, or one of more, is an error."""
        it = iter(self)
        first = next(it, _END)
        if first is _END:
            raise InvalidArgumentError("get_single_element: Dataset was empty.")
        if next(it, _END) is not _END:
            raise InvalidArgumentError("get_single_element: Dataset had more than one element.")
        return first

    def with_options(self, options: Any, name: str | None = None) -> Dataset:
        """The same elements, with ``options`` (:class:`Options`, or TF's ``tf.data.Options``)
        kept for :meth:`options`. Not applied: as in TF, a per-worker dataset of the
        parameter-server strategy ignores its options (shard it with ``shard``)."""
        out = Dataset(
            self._make, spec=self._spec, partial_batch=self._partial_batch, cardinality=self._cardinality
        )
        out._source, out._indices = self._source, self._indices
        out._options = options
        return out

    def options(self) -> Any:
        """The options :meth:`with_options` gave (a fresh :class:`Options` if none)."""
        return self._options if self._options is not None else Options()

    _options: Any = None

    def unbatch(self) -> Dataset:
        """Each element split along its first dimension into as many elements (tuples and
        dicts component-wise, which must agree on it); the inverse of ``batch``. Its
        cardinality is known when that dimension is (a batch with ``drop_remainder``, rows
        of arrays sliced or given whole), as TF's; after a ``map`` it is not (TF's knows the
        function's output shapes, pstrain only by running it)."""
        make = self._make
        n, rows = self._cardinality, self._rows
        count = n if n < 0 else (n * rows if rows is not None else UNKNOWN_CARDINALITY)
        return Dataset(lambda: (row for e in make() for row in rows_of(e)), cardinality=count)

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """The elements of the datasets ``map_func`` returns for each element, in order."""
        _callable(map_func, "flat_map")
        make = self._make

        def run() -> Iterator[Any]:
            for e in make():
                yield from _returned_dataset(map_func, e, "flat_map")

        return Dataset(run)

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then ``dataset``'s (of the same structure and dtypes)."""
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"concatenate takes a Dataset, got {type(dataset).__name__}")
        first, second = self._make, dataset._make

        def run() -> Iterator[Any]:
            shape = None
            for e in first():
                shape = structure_of(e) if shape is None else shape
                yield e
            for e in second():
                if shape is not None and structure_of(e) != shape:
                    raise InvalidArgumentError(
                        f"concatenate: the second dataset's elements ({structure_of(e)}) are not of "
                        f"the first's structure and dtypes ({shape})"
                    )
                shape = None  # (checked once)
                yield e

        n1, n2 = self._cardinality, int(dataset.cardinality())
        if INFINITE_CARDINALITY in (n1, n2):
            both = INFINITE_CARDINALITY
        else:
            both = UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in (n1, n2) else n1 + n2
        rows = self._rows if self._rows == dataset._rows else None
        return Dataset(run, cardinality=both, rows=rows)

    @staticmethod
    def zip(*datasets: Any) -> Dataset:
        """Elements side by side, until the shortest ends, in the structure the datasets are
        given in, nested too, as TF's: ``Dataset.zip((a, b))`` (or ``Dataset.zip(a, b)``)
        gives tuples, ``Dataset.zip({"x": a, "y": (b, c)})`` dicts of them, ``Dataset.zip(a)``
        ``a``'s elements."""
        nest: Any = datasets[0] if len(datasets) == 1 else datasets
        parts: list[Dataset] = []
        try:
            _flatten_datasets(nest, parts)
        except InvalidArgumentError:
            raise InvalidArgumentError(
                "Dataset.zip takes Datasets: a (nested) tuple or dict of them, or several as arguments"
            ) from None
        if not parts:
            raise InvalidArgumentError("Dataset.zip takes at least one Dataset")

        def run() -> Iterator[Any]:
            for row in zip(*(iter(d) for d in parts)):
                yield _packed(nest, iter(row))

        sizes = [int(d.cardinality()) for d in parts]
        if UNKNOWN_CARDINALITY in sizes:
            shortest = UNKNOWN_CARDINALITY
        else:
            shortest = min((n for n in sizes if n >= 0), default=INFINITE_CARDINALITY)
        return Dataset(run, cardinality=shortest)

    def cache(self, filename: str = "") -> Dataset:
        """Keep the elements of the first complete iteration in memory and give them again
        on later ones (the pipeline before it, and its ``map``s, run once). An iteration
        stopped part way caches nothing. A ``filename`` (TF's cache on disk) is refused."""
        if filename:
            raise InvalidArgumentError(
                f"cache({filename!r}): a cache on disk is not supported; cache() keeps the elements in memory"
            )
        make = self._make
        done: list[list[Any]] = []

        def run() -> Iterator[Any]:
            if done:
                yield from done[0]
                return
            kept = []
            for e in make():
                kept.append(e)
                yield e
            if not done:
                done.append(kept)

        return self._same_elements(run)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """``transformation_func(self)``, as TF's."""
        _callable(transformation_func, "apply")
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise InvalidArgumentError(f"apply: the function must return a Dataset, got {type(out).__name__}")
        return out

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements (already numpy here), as TF's."""
        return iter(self)

    def prefetch(self, buffer_size: int = 1) -> Dataset:
        """Produce up to ``buffer_size`` elements ahead in a background thread."""
        whole(buffer_size, "prefetch buffer_size (AUTOTUNE is -1: here 1)", AUTOTUNE)
        make = self._make
        size = max(1, buffer_size)

        def run() -> Iterator[Any]:
            q: queue.Queue[Any] = queue.Queue(size)
            stop = threading.Event()
            done = object()

            def fill() -> None:
                try:
                    for x in make():
                        while not stop.is_set():
                            try:
                                q.put((None, x), timeout=0.1)
                                break
                            except queue.Full:
                                continue
                        if stop.is_set():
                            return
                    q.put((None, done))
                except BaseException as exc:  # surfaced to the consumer
                    q.put((exc, done))

            thread = threading.Thread(target=fill, daemon=True, name="pstrain-prefetch")
            thread.start()
            try:
                while True:
                    exc, x = q.get()
                    if exc is not None:
                        raise exc
                    if x is done:
                        return
                    yield x
            finally:
                stop.set()

        return self._same_elements(run)


expose(globals(), "pstrain.data")
