"""The elements of a ``pstrain.data`` pipeline: a component (an array, or a batch of bags: a
``JaggedTensor`` or ``KeyedJaggedTensor``), or a tuple or dict of them, nested. What the
``Dataset`` steps do to one: slice rows out of it, stack rows into a batch, split a batch
into rows, pad a batch, and tell two elements' structures apart."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._kernels.batches import take_examples

__all__ = [
    "BAGS",
    "COMPONENT_CONVERTERS",
    "SPARSE",
    "ROW_SOURCES",
    "OneStructure",
    "first_dimension",
    "is_jagged",
    "leaves_len",
    "padded",
    "ragged",
    "rows_of",
    "sparse",
    "stack",
    "structure_of",
    "take",
    "to_arrays",
    "unique_key",
]


def is_jagged(x: Any) -> bool:
    """Is ``x`` a batch of variable-length rows (a ``JaggedTensor`` or ``KeyedJaggedTensor``:
    ``len``, ``take(rows)`` and ``type(x).concat_rows(parts)``)? Kept whole, taken by rows."""
    return hasattr(type(x), "take") and hasattr(type(x), "concat_rows") and hasattr(x, "__len__")


def leaves_len(structure: Any, what: str = "from_tensor_slices") -> int:
    if isinstance(structure, dict):
        lengths = {leaves_len(v, what) for v in structure.values()}
    elif isinstance(structure, tuple):
        lengths = {leaves_len(v, what) for v in structure}
    elif not is_jagged(structure) and np.ndim(structure) == 0:
        raise InvalidArgumentError(
            f"{what}: a component has no first dimension to slice (a scalar: {structure!r})"
        )
    else:
        return len(structure)
    if len(lengths) != 1:
        raise InvalidArgumentError(f"{what}: components have different lengths {sorted(lengths)}")
    return lengths.pop()


#: Turn a component of a type defined above this layer into one that slices by rows (a
#: SparseTensor or RaggedTensor, pstrain's or TF's, into a ``JaggedTensor``), or return None.
COMPONENT_CONVERTERS: list[Callable[[Any], Any]] = []
#: Turn a batch of bags that ``from_tensor_slices`` slices into what takes its rows as the
#: same type faster (a ``KeyedJaggedTensor`` kept example by example), or return None.
ROW_SOURCES: list[Callable[[Any], Any]] = []
#: The type of a batch of bags of ids, ``(values, lengths)``: ``JaggedTensor`` (``ragged_batch``).
BAGS: list[Callable[[np.ndarray, np.ndarray], Any]] = []
#: The type of a SparseTensor, ``(indices, values, dense_shape)``: ``SparseTensor`` (``sparse_batch``).
SPARSE: list[Callable[[np.ndarray, np.ndarray, np.ndarray], Any]] = []


def to_arrays(structure: Any, sliced: bool = False) -> Any:
    """``structure`` with each component an array or a batch of bags; ``sliced`` (what
    ``from_tensor_slices`` takes rows from): each batch of bags as :data:`ROW_SOURCES` keeps it."""
    if is_jagged(structure):
        for convert in ROW_SOURCES if sliced else ():
            converted = convert(structure)
            if converted is not None:
                return converted
        return structure
    for convert in COMPONENT_CONVERTERS:
        converted = convert(structure)
        if converted is not None:
            return converted
    if isinstance(structure, dict):
        return {k: to_arrays(v, sliced) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(to_arrays(v, sliced) for v in structure)
    try:
        return np.asarray(structure)
    except ValueError:  # (numpy: "inhomogeneous shape")
        raise InvalidArgumentError(
            "from_tensor_slices: a component's rows differ in length; give it as a "
            "pstrain.JaggedTensor (or a RaggedTensor, pstrain's or TF's), whose rows are bags"
        ) from None


def take(structure: Any, index: Any) -> Any:
    if is_jagged(structure):  # one row stays a batch of one: batching after a map concatenates
        return structure.take(np.atleast_1d(index))
    if isinstance(structure, dict):
        return {k: take(v, index) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(take(v, index) for v in structure)
    if isinstance(structure, np.ndarray) and isinstance(index, np.ndarray) and index.dtype == np.int64:
        return take_examples(structure, index)  # a batch's rows: the indices are in range
    return structure[index]


def stack(elements: list[Any]) -> Any:
    first = elements[0]
    if is_jagged(first):
        return type(first).concat_rows(elements)
    if isinstance(first, dict):
        return {k: stack([e[k] for e in elements]) for k in first}
    if isinstance(first, tuple):
        return tuple(stack([e[i] for e in elements]) for i in range(len(first)))
    if type(first) is bytes:  # a file's records or lines: kept whole (numpy's bytes drop end NULs)
        out = np.empty(len(elements), object)
        out[:] = elements
        return out
    arrays = [np.asarray(e) for e in elements]
    for i, a in enumerate(arrays):
        if a.shape != arrays[0].shape:
            raise InvalidArgumentError(
                f"batch: cannot batch elements of different shapes: the first had shape "
                f"{arrays[0].shape} and element {i} had shape {a.shape} (padded_batch pads them; "
                "bags of ids batch as a JaggedTensor)"
            )
    return np.stack(arrays)


def ragged(elements: list[Any], spec: Any = None, where: str = "") -> Any:
    """``ragged_batch``'s batch of ``elements``, component by component (``spec``: the
    dataset's declared element_spec, or None)."""
    first = elements[0]
    if isinstance(first, dict):
        return {k: ragged([e[k] for e in elements], _part(spec, k), f"{where}[{k!r}]") for k in first}
    if isinstance(first, tuple):
        return tuple(
            ragged([e[i] for e in elements], _part(spec, i), f"{where}[{i}]") for i in range(len(first))
        )
    if is_jagged(first):
        return type(first).concat_rows(elements)
    arrays = [np.asarray(e) for e in elements]
    declared = getattr(spec, "shape", None)
    if declared is not None:
        bags = len(declared) == 1 and declared[0] is None
    else:
        bags = all(a.ndim == 1 and a.dtype.kind in "iu" for a in arrays)
    if bags:
        bad = next((a for a in arrays if a.ndim != 1 or (a.size and a.dtype.kind not in "iu")), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"ragged_batch: component{where} holds ids of variable length, but an element "
                f"is {bad.dtype} of shape {bad.shape}"
            )
        lengths = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
        return BAGS[0](np.concatenate(arrays), lengths)
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise InvalidArgumentError(
            f"ragged_batch: component{where}'s elements have shapes {sorted(shapes)}: only 1-D "
            "integer ids batch as bags (a JaggedTensor); padded_batch pads other elements"
        )
    return np.stack(arrays)


def sparse(elements: list[Any], row_shape: tuple[int | None, ...]) -> Any:
    """``sparse_batch``'s batch of ``elements`` (arrays of one rank, each no larger than
    ``row_shape``, None in it: the batch's largest) as a SparseTensor holding every entry of
    each, element ``i``'s at ``[i, *its index]``, as TF's."""
    if isinstance(elements[0], (tuple, dict)):
        raise InvalidArgumentError(
            "sparse_batch takes a dataset whose elements are one array each (as TF's), got a "
            f"{type(elements[0]).__name__}: map it to one component first"
        )
    arrays = [np.asarray(e) for e in elements]
    rank = len(row_shape)
    for i, a in enumerate(arrays):
        if a.ndim != rank:
            raise InvalidArgumentError(
                f"sparse_batch: element {i} has shape {a.shape}, not of the rank of row_shape "
                f"{list(row_shape)}"
            )
        if any(d is not None and n > d for n, d in zip(a.shape, row_shape)):
            raise InvalidArgumentError(
                f"sparse_batch: element {i} has shape {a.shape}, larger than row_shape {list(row_shape)}"
            )
        if a.dtype != arrays[0].dtype:
            raise InvalidArgumentError(
                f"sparse_batch: element {i} is {a.dtype} where the first was {arrays[0].dtype}"
            )
    dense_shape = np.array(
        [len(arrays)]
        + [d if d is not None else max(a.shape[k] for a in arrays) for k, d in enumerate(row_shape)],
        np.int64,
    )
    indices = np.concatenate(
        [np.zeros((0, rank + 1), np.int64)]
        + [
            np.column_stack([np.full(a.size, i, np.int64), np.indices(a.shape).reshape(rank, a.size).T])
            for i, a in enumerate(arrays)
        ]
    )
    values = np.concatenate([a.reshape(-1) for a in arrays])
    return SPARSE[0](indices, values, dense_shape)


def rows_of(element: Any) -> Iterator[Any]:
    """``element``'s rows along its first dimension (``unbatch``): component-wise for tuples
    and dicts, which must agree on it; a jagged component's rows stay batches of one."""
    n = leaves_len(element, "unbatch") if isinstance(element, (tuple, dict)) or is_jagged(element) else None
    if n is None:
        arr = np.asarray(element)
        if arr.ndim == 0:
            raise InvalidArgumentError("unbatch: an element has no first dimension (a scalar)")
        n = arr.shape[0]
        element = arr
    for i in range(n):
        yield take(element, np.int64(i)) if not is_jagged(element) else element.take(np.array([i]))


def structure_of(element: Any) -> Any:
    """What two datasets' elements must share to follow one another or mix (``concatenate``,
    ``choose_from_datasets``): the nesting, dict keys, and each component's dtype (strings
    as one), as TF's compatible element specs; shapes may differ, as TF's may."""
    if isinstance(element, dict):
        return {k: structure_of(v) for k, v in element.items()}
    if isinstance(element, tuple):
        return tuple(structure_of(v) for v in element)
    if is_jagged(element):
        return type(element).__name__
    if isinstance(element, (bytes, str)):
        return "string"
    arr = np.asarray(element)
    return "string" if arr.dtype.kind in "USO" else arr.dtype.name


class OneStructure:
    """Checks that the datasets an operation draws from give elements of one structure and
    dtypes (TF's "compatible element specs"), each dataset on its first element."""

    def __init__(self, what: str, count: int) -> None:
        self.what, self.unchecked = what, set(range(count))
        self.first: tuple[int, Any] | None = None

    def check(self, k: int, element: Any) -> None:
        if k not in self.unchecked:
            return
        self.unchecked.discard(k)
        got = structure_of(element)
        if self.first is None:
            self.first = (k, got)
        elif got != self.first[1]:
            raise InvalidArgumentError(
                f"{self.what}: dataset {k}'s elements ({got}) are not of the structure and dtypes "
                f"of dataset {self.first[0]}'s ({self.first[1]}), as TF requires"
            )


def first_dimension(structure: Any, sliced: bool) -> int | None:
    """The first dimension every array of ``structure`` gives its elements (``sliced``: the
    rows of its arrays are the elements), if they all agree; None if they do not, or if an
    element is a scalar or a batch of bags (what ``unbatch`` counts by)."""
    sizes: set[int] = set()

    def visit(x: Any) -> bool:
        if isinstance(x, dict):
            return all(visit(v) for v in x.values())
        if isinstance(x, tuple):
            return all(visit(v) for v in x)
        if not isinstance(x, np.ndarray) or x.ndim < (2 if sliced else 1):
            return False
        sizes.add(int(x.shape[1] if sliced else x.shape[0]))
        return True

    return sizes.pop() if visit(structure) and len(sizes) == 1 else None


def unique_key(element: Any) -> Any:
    """What ``unique`` tells ``element`` apart by: its shape and values (bytes as given:
    numpy drops their trailing NULs)."""
    if isinstance(element, bytes):
        return element
    if isinstance(element, (tuple, dict)):
        raise InvalidArgumentError("unique takes elements of one component (as TF's), got a tuple or dict")
    arr = np.asarray(element)
    if arr.dtype.kind in "iu":
        return (arr.shape, arr.dtype.str, arr.tobytes())
    if arr.dtype.kind in "US" or (arr.dtype == object and all(isinstance(x, bytes) for x in arr.flat)):
        return (arr.shape, tuple(arr.flat))
    raise InvalidArgumentError(
        f"unique: elements must be integers or strings (as TF's), got {arr.dtype} of shape {arr.shape}"
    )


def padded(elements: list[Any], shapes: Any, values: Any) -> Any:
    """``padded_batch``'s batch of ``elements``, component by component."""
    first = elements[0]
    if isinstance(first, dict):
        return {k: padded([e[k] for e in elements], _part(shapes, k), _part(values, k)) for k in first}
    if isinstance(first, tuple):
        return tuple(
            padded([e[i] for e in elements], _part(shapes, i), _part(values, i)) for i in range(len(first))
        )
    if is_jagged(first):
        raise InvalidArgumentError(
            "padded_batch pads arrays: bags of ids (a JaggedTensor) batch as they are with batch()"
        )
    arrays = [np.asarray(e) for e in elements]
    ranks = {a.ndim for a in arrays}
    if len(ranks) != 1:
        raise InvalidArgumentError(f"padded_batch: elements of ranks {sorted(ranks)} in one component")
    longest = np.max([a.shape for a in arrays], axis=0).astype(int) if arrays[0].ndim else np.zeros(0, int)
    target = list(longest)
    if shapes is not None:
        given = list(shapes) if isinstance(shapes, (list, tuple, np.ndarray)) else [shapes]
        if len(given) != len(target):
            raise InvalidArgumentError(
                f"padded_batch: padded shape {shapes!r} for elements of rank {len(target)}"
            )
        for d, want in enumerate(given):
            if want is not None and int(want) >= 0:
                if int(want) < longest[d]:
                    raise InvalidArgumentError(
                        f"padded_batch: an element is {longest[d]} long in dimension {d}, past its "
                        f"padded shape {shapes!r}"
                    )
                target[d] = int(want)
    dtype = np.result_type(*arrays)
    if values is None:
        fill: Any = "" if dtype.kind in "US" else False if dtype.kind == "b" else 0
    else:
        fill = values
    out = np.full((len(arrays), *target), fill, dtype)
    for i, a in enumerate(arrays):
        where: tuple[Any, ...] = (i, *(slice(0, k) for k in a.shape))
        out[where] = a
    return out


def _part(structure: Any, key: Any) -> Any:
    """Component ``key`` of a ``padded_shapes`` or ``padding_values`` given per component
    (a tuple or dict; anything else applies to every component)."""
    if isinstance(structure, dict):
        return structure.get(key)
    if isinstance(structure, tuple):
        return structure[key]
    return structure
