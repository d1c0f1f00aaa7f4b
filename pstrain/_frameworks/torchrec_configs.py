"""TorchRec's table definitions, mapped one to one onto :class:`~pstrain.TableConfig`.

A port keeps its ``EmbeddingBagConfig``\\ s (pooled tables, for an
``EmbeddingBagCollection``) and ``EmbeddingConfig``\\ s (unpooled ones, for an
``EmbeddingCollection``) as they are: TorchRec's own objects, or this module's classes of
the same names and fields for a program that no longer imports TorchRec. Every field
either has a meaning here or is refused by name: a setting that would change the model is
never dropped quietly.

=================================  ==================================================
``EmbeddingBagConfig``             ``TableConfig``
=================================  ==================================================
``name``, ``num_embeddings``,      the same
``embedding_dim``,
``feature_names``
``pooling`` SUM / MEAN             ``combiner="sum"`` / ``"mean"`` (NONE refused: a
                                   bag collection pools; an ``EmbeddingConfig`` has
                                   no pooling, and an ``EmbeddingCollection``
                                   ignores an ``EmbeddingBagConfig``'s, as TorchRec's)
``weight_init_min`` / ``_max``     ``RandomUniform(min, max)``, TorchRec's default
                                   ±sqrt(1 / num_embeddings)
``init_fn``                        the same distribution as a pstrain initializer
                                   (``uniform_``, ``normal_``, ``trunc_normal_`` at
                                   two standard deviations, ``constant_``,
                                   ``zeros_``, ``ones_``, ``xavier_uniform_``,
                                   ``xavier_normal_``); any other refused
``data_type`` FP32 / FP16          ``dtype=float32`` / ``float16`` (others refused)
``use_virtual_table=True``         ``num_embeddings=None``: a dynamic table
``num_embeddings_post_pruning``    accepted, unused (inference only, as in TorchRec's
                                   unsharded collection)
=================================  ==================================================

``need_pos``, ``input_dim``, ``total_num_buckets``, ``virtual_table_eviction_policy``,
``enable_embedding_update`` and ``stash_weights`` are refused when set: they belong to
TorchRec's sharded kernels, which have no counterpart here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._embeddings.config import TableConfig
from .._formats.numerics.initializers import (
    Constant,
    Initializer,
    Ones,
    RandomNormal,
    RandomUniform,
    TruncatedNormal,
    Zeros,
)

__all__ = ["DataType", "EmbeddingBagConfig", "EmbeddingConfig", "PoolingType", "table_configs"]


class PoolingType(enum.Enum):
    """TorchRec's ``PoolingType``: how a bag's rows combine (``NONE`` is refused by a bag
    collection: it pools; unpooled lookups are an ``EmbeddingCollection``'s)."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    """TorchRec's ``DataType``: a table's number type (``FP32`` and ``FP16`` map to tables
    of ``float32`` and ``float16``; the others are refused)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT64 = "INT64"
    INT32 = "INT32"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT4 = "INT4"
    INT2 = "INT2"
    NFP8 = "NFP8"


@dataclasses.dataclass
class _BaseEmbeddingConfig:
    """TorchRec's ``BaseEmbeddingConfig``: a table's fields in TorchRec's order with its
    defaults (but ``init_fn``, which stays None where TorchRec fills in its default uniform;
    the mapping gives the same). See the module's table for what each field becomes."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: Any = DataType.FP32
    feature_names: list[str] = dataclasses.field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Callable[[torch.Tensor], Any] | None = None
    need_pos: bool = False
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: Any = None
    enable_embedding_update: bool = False
    stash_weights: bool = False

    def get_weight_init_max(self) -> float:
        """``weight_init_max``, or TorchRec's default sqrt(1 / num_embeddings)."""
        return math.sqrt(1 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max

    def get_weight_init_min(self) -> float:
        """``weight_init_min``, or TorchRec's default -sqrt(1 / num_embeddings)."""
        return -math.sqrt(1 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)


@dataclasses.dataclass
class EmbeddingConfig(_BaseEmbeddingConfig):
    """TorchRec's ``EmbeddingConfig``: an unpooled table, for
    :class:`~pstrain.torch.EmbeddingCollection` (its fields: see the module's table)."""


@dataclasses.dataclass
class EmbeddingBagConfig(_BaseEmbeddingConfig):
    """TorchRec's ``EmbeddingBagConfig``: a pooled table, for
    :class:`~pstrain.torch.EmbeddingBagCollection`: TorchRec's fields in its order with its
    defaults, ``pooling`` last (what each becomes: see the module's table)."""

    pooling: PoolingType = PoolingType.SUM


#: Fields of TorchRec's sharded kernels: refused unless left at these defaults.
_UNSUPPORTED = {
    "need_pos": False,
    "input_dim": None,
    "total_num_buckets": None,
    "virtual_table_eviction_policy": None,
    "enable_embedding_update": False,
    "stash_weights": False,
}

_DTYPES = {"FP32": np.float32, "FP16": np.float16}


def table_configs(tables: Sequence[Any], pooled: bool = True) -> list[TableConfig]:
    """pstrain :class:`~pstrain.TableConfig`\\ s from TorchRec ``EmbeddingBagConfig``\\ s (or
    ``TableConfig``\\ s, kept), one to one, as the module's table says. ``pooled=False``:
    tables of an ``EmbeddingCollection`` (``EmbeddingConfig``\\ s, or bag configs whose
    pooling it ignores, as TorchRec's does)."""
    return [t if isinstance(t, TableConfig) else _table_config(t, pooled) for t in tables]


def _table_config(t: Any, pooled: bool = True) -> TableConfig:
    try:
        rows, dim, name = int(t.num_embeddings), int(t.embedding_dim), str(t.name)
        given = t.feature_names
    except AttributeError as exc:
        raise InvalidArgumentError(
            f"tables: expected TableConfig or TorchRec's EmbeddingBagConfig, got {type(t).__name__}"
        ) from exc
    if (
        isinstance(given, str)
        or not isinstance(given, (list, tuple))
        or not all(isinstance(f, str) for f in given)
    ):
        raise InvalidArgumentError(
            f"table {name!r}: feature_names must be a list of names, got {given!r} (a config "
            "written by position: data_type comes fourth, after name, as in TorchRec)"
        )
    features = list(given)
    name = name or (features[0] if len(features) == 1 else name)
    if not name:
        raise InvalidArgumentError("tables: an EmbeddingBagConfig needs a name")
    for field, default in _UNSUPPORTED.items():
        value = getattr(t, field, default)
        if value != default:
            raise InvalidArgumentError(
                f"table {name!r}: {field}={value!r} is a setting of TorchRec's sharded kernels, "
                f"which pstrain has no counterpart for; leave it at {default!r}"
            )
    if pooled and not hasattr(t, "pooling"):
        raise InvalidArgumentError(
            f"table {name!r} is an EmbeddingConfig, which has no pooling: give it to "
            "pstrain.torch.EmbeddingCollection (unpooled lookups), or make it an "
            "EmbeddingBagConfig for an EmbeddingBagCollection"
        )
    # (an EmbeddingCollection never pools: its tables' combiner is never used)
    pooling = getattr(t.pooling, "name", "SUM") if pooled else "SUM"
    if pooling not in ("SUM", "MEAN"):
        raise InvalidArgumentError(
            f"table {name!r}: pooling {pooling} has no pstrain combiner (SUM or MEAN); an "
            "unpooled lookup is pstrain.nn.embedding_lookup (or pstrain.torch.Embedding)"
        )
    return TableConfig(
        name,
        None if getattr(t, "use_virtual_table", False) else rows,
        dim,
        features or [name],
        combiner=pooling.lower(),
        initializer=_initializer(t, name, rows, dim),
        dtype=_dtype(getattr(t, "data_type", None), name),
    )


def _dtype(data_type: Any, name: str) -> np.dtype:
    """A table's dtype from TorchRec's ``DataType`` (or a numpy or torch dtype)."""
    if data_type is None:
        return np.dtype(np.float32)
    if isinstance(data_type, torch.dtype):
        return torch.empty(0, dtype=data_type).numpy().dtype
    if isinstance(data_type, (type, np.dtype, str)):
        return np.dtype(data_type)
    kind = getattr(data_type, "name", None)
    if kind not in _DTYPES:
        raise InvalidArgumentError(
            f"table {name!r}: data_type {kind or repr(data_type)} has no pstrain table type (FP32 or FP16)"
        )
    return np.dtype(_DTYPES[kind])


def _initializer(t: Any, name: str, rows: int, dim: int) -> Initializer:
    low = getattr(t, "weight_init_min", None)
    high = getattr(t, "weight_init_max", None)
    bound = math.sqrt(1.0 / rows)
    default = RandomUniform(-bound if low is None else float(low), bound if high is None else float(high))
    fn = getattr(t, "init_fn", None)
    if fn is None:
        return default
    func, settings = _call_of(fn)
    init = torch.nn.init
    if func is init.uniform_:
        return RandomUniform(settings.get("a", 0.0), settings.get("b", 1.0))
    if func is init.normal_:
        return RandomNormal(settings.get("mean", 0.0), settings.get("std", 1.0))
    if func is init.constant_ and "val" in settings:
        return Constant(float(settings["val"]))
    if func is init.zeros_:
        return Zeros()
    if func is init.ones_:
        return Ones()
    if func in (init.xavier_uniform_, init.xavier_normal_):
        # PyTorch's fans of a (rows, dim) weight are dim and rows; the bound needs their sum.
        std = float(settings.get("gain", 1.0)) * math.sqrt(2.0 / (rows + dim))
        if func is init.xavier_normal_:
            return RandomNormal(0.0, std)
        return RandomUniform(-math.sqrt(3.0) * std, math.sqrt(3.0) * std)
    if func is init.trunc_normal_:
        mean, std = float(settings.get("mean", 0.0)), float(settings.get("std", 1.0))
        a, b = float(settings.get("a", -2.0)), float(settings.get("b", 2.0))
        if math.isclose(a, mean - 2 * std) and math.isclose(b, mean + 2 * std):
            return TruncatedNormal(mean, std)
        raise InvalidArgumentError(
            f"table {name!r}: init_fn trunc_normal_ cut at [{a:g}, {b:g}]; pstrain's "
            f"TruncatedNormal cuts at two standard deviations ([{mean - 2 * std:g}, "
            f"{mean + 2 * std:g}]): give TableConfig(initializer=...) instead"
        )
    raise InvalidArgumentError(
        f"table {name!r}: init_fn {fn!r} has no pstrain initializer (the table is made on the "
        "ps): use torch.nn.init's uniform_, normal_, trunc_normal_, constant_, zeros_, ones_, "
        "xavier_uniform_ or xavier_normal_ (alone or in functools.partial), or give "
        "TableConfig(initializer=...) instead"
    )


def _call_of(fn: Any) -> tuple[Any, dict[str, Any]]:
    """The function an ``init_fn`` calls and the settings it fixes (a ``functools.partial``'s
    arguments after the tensor, by name)."""
    if not isinstance(fn, functools.partial):
        return fn, {}
    try:
        bound = inspect.signature(fn.func).bind_partial(None, *fn.args, **fn.keywords)
    except (TypeError, ValueError):
        return fn, {}
    return fn.func, {k: v for k, v in bound.arguments.items() if k != "tensor"}


expose(globals(), "pstrain.torch")
