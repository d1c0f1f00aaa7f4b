"""Pooled embeddings for PyTorch models: ``nn.EmbeddingBag`` and TorchRec's
``EmbeddingBagCollection`` with their tables on the ps.

::

    import pstrain.torch as ptorch

    with strategy.scope():
        ebc = ptorch.EmbeddingBagCollection(tables)   # TableConfigs, or TorchRec's configs
        # (ptorch.table_configs(torchrec_configs) maps them one to one)

    async def step(iterator):
        kjt, dense, y = next(iterator)                # a pstrain.KeyedJaggedTensor
        await ebc.pull(kjt)                           # one request per ps, every table
        pooled = ebc(kjt)                             # a KeyedTensor: .values() is [B, sum of dims]
        loss = ...(pooled.values(), dense, y)
        loss.backward()
        await optimizer.apply_gradients(ebc.gradients())

Pooling runs as ``torch.nn.functional.embedding_bag`` over the batch's distinct rows (a
leaf tensor), so the gradients are PyTorch's own, per-sample weights included, and go back
as :class:`~pstrain.IndexedSlices` over the distinct ids: only looked-up rows travel.
A collection's poolings are TorchRec's ``SUM`` and ``MEAN``; its batches' weights count only
with ``is_weighted=True`` (TorchRec ignores them otherwise). :class:`EmbeddingBag` adds
``nn.EmbeddingBag``'s ``"max"``, ``padding_idx`` and ``include_last_offset``. Per-sample
weights go only with ``"sum"``, as in PyTorch; an empty bag pools to zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._checkpoint.object_graph import register_view
from .._embeddings.jagged import JaggedTensor, KeyedJaggedTensor
from .._formats.numerics.initializers import Initializer, RandomUniform
from .._kernels.batches import distinct
from .._variables.arrays import IndexedSlices
from .._variables.sharding import embedding_lookup
from .._variables.variables import Variable
from .fetched import FetchedBatches, writable
from .torch_pulled import PulledCollection
from .torchrec_configs import table_configs

__all__ = ["EmbeddingBag", "EmbeddingBagCollection", "KeyedTensor"]

_MODES = ("sum", "mean")


class KeyedTensor:
    """TorchRec's ``KeyedTensor``: the features' pooled rows side by side (``values()``,
    ``[batch, sum of dims]``), with their names (``keys()``) and widths."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = keys, length_per_key, values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        """Where each key's columns start in :meth:`values`, then the width."""
        return [0, *np.cumsum(self._lengths, dtype=np.int64).tolist()]

    def key_dim(self) -> int:
        """The dimension of :meth:`values` the keys run along (TorchRec's: 1)."""
        return 1

    def to_dict(self) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for k, n in zip(self._keys, self._lengths):
            out[k] = self._values[:, start : start + n]
            start += n
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]

    @staticmethod
    def from_tensor_list(
        keys: list[str], tensors: list[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """TorchRec's: the tensors side by side (along ``cat_dim``), each the columns of its key."""
        if len(keys) != len(tensors) or key_dim != 1 or cat_dim != 1:
            raise InvalidArgumentError(
                "KeyedTensor.from_tensor_list: a tensor per key, side by side along dimension 1"
            )
        return KeyedTensor(list(keys), [int(t.shape[1]) for t in tensors], torch.cat(tensors, dim=1))

    @staticmethod
    def regroup(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
        """TorchRec's: for each group of keys (found in any of ``keyed_tensors``), their
        columns side by side, in the group's order (gradients flow back through them)."""
        columns: dict[str, torch.Tensor] = {}
        for kt in keyed_tensors:
            columns.update(kt.to_dict())
        missing = sorted({k for group in groups for k in group} - set(columns))
        if missing:
            raise InvalidArgumentError(f"KeyedTensor.regroup: no keyed tensor has the keys {missing}")
        return [torch.cat([columns[k] for k in group], dim=1) for group in groups]

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: list[KeyedTensor], groups: list[list[str]], keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """TorchRec's: :meth:`regroup`'s tensors by the names ``keys`` (one per group)."""
        if len(keys) != len(groups):
            raise InvalidArgumentError("KeyedTensor.regroup_as_dict: a name per group")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))


def _bag(
    weight: torch.Tensor, jagged: JaggedTensor, inverse: np.ndarray, mode: str, what: str, weighted: bool
) -> torch.Tensor:
    """One feature's bags pooled from the distinct rows ``weight``; the batch's weights count
    only for a weighted collection (TorchRec's ``is_weighted``: otherwise they are ignored)."""
    if not weighted and jagged.weights is not None:
        jagged = JaggedTensor(jagged.values, offsets=jagged.offsets)
    if jagged.weights is not None and mode != "sum":
        raise InvalidArgumentError(
            f"{what}: per-sample weights go only with mode 'sum' (as nn.EmbeddingBag), got {mode!r}"
        )
    weights = (
        None
        if jagged.weights is None
        else torch.from_numpy(np.ascontiguousarray(jagged.weights, np.float32)).to(weight.dtype)
    )
    return torch.nn.functional.embedding_bag(
        torch.from_numpy(np.ascontiguousarray(inverse, np.int64)),
        weight,
        torch.from_numpy(np.ascontiguousarray(jagged.offsets[:-1], np.int64)),
        mode=mode,
        per_sample_weights=weights,
    )


class EmbeddingBagCollection(PulledCollection):
    """TorchRec's ``EmbeddingBagCollection`` on the ps: the tables of an
    :class:`~pstrain.EmbeddingCollection` (placed by its planner), pooled by PyTorch. Create
    it in ``strategy.scope()``; ``tables`` are :class:`~pstrain.TableConfig` (combiner
    ``"sum"`` or ``"mean"``) or TorchRec ``EmbeddingBagConfig``\\ s (see
    :func:`table_configs`)."""

    def __init__(
        self,
        tables: Sequence[Any],
        is_weighted: bool = False,
        device: Any = None,
        *,
        shard_rows: int | None = None,
        name: str = "embedding_bags",
    ) -> None:
        configs = table_configs(tables)
        for c in configs:
            if c.combiner not in _MODES:
                raise InvalidArgumentError(
                    f"table {c.name!r}: combiner {c.combiner!r} has no "
                    f"nn.EmbeddingBag mode (use 'sum' or 'mean')"
                )
        super().__init__(configs, shard_rows, name)
        # TorchRec's flag: batches carry per-id weights. ``device`` is accepted and unused
        # (the tables live on the ps; pooling runs on the CPU of the worker).
        self._is_weighted = bool(is_weighted)
        self._configs = list(tables)

    def is_weighted(self) -> bool:
        """TorchRec's: whether the batches' per-id weights count."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs as given (TorchRec's ``EmbeddingBagConfig``\\ s, or ``TableConfig``\\ s)."""
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor | Mapping[str, Any]) -> KeyedTensor:
        given = self._features(features)
        pulled = self._pulled_for(given)
        gathered = pulled.gathered
        if self._is_weighted and any(j.weights is None for j in given.values()):
            raise InvalidArgumentError(
                "EmbeddingBagCollection(is_weighted=True): the batch has features without weights"
            )
        parts: dict[str, torch.Tensor] = {}
        for name, (_, named) in gathered.bags.items():
            combiner = self.collection.configs[name].combiner
            for feature, bags in named:
                parts[feature] = _bag(
                    pulled.rows[name],
                    gathered.features[feature],
                    bags.inverse,
                    combiner,
                    f"feature {feature!r}",
                    self._is_weighted,
                )
        keys = self.collection.feature_names
        return KeyedTensor(
            keys, [parts[f].shape[1] for f in keys], torch.cat([parts[f] for f in keys], dim=1)
        )


class _BagFetch:
    """One fetch of bags: the bags, their distinct ids, where each id is among them, the
    zero row standing for ``padding_idx`` (or None), and the rows as a leaf tensor."""

    __slots__ = ("jagged", "unique", "inverse", "padding_row", "rows")

    def __init__(
        self,
        jagged: JaggedTensor,
        unique: np.ndarray,
        inverse: np.ndarray,
        padding_row: int | None,
        rows: torch.Tensor,
    ) -> None:
        self.jagged, self.unique, self.inverse, self.padding_row, self.rows = (
            jagged,
            unique,
            inverse,
            padding_row,
            rows,
        )


class EmbeddingBag(torch.nn.Module):
    """``nn.EmbeddingBag`` with its table on the ps (sharded by the strategy's partitioner):
    ``await bag.fetch(input, offsets, per_sample_weights)`` gathers the rows, then
    ``bag(input, offsets, per_sample_weights)`` pools them as ``nn.EmbeddingBag`` does:
    ``input`` 2-D (bags as long, no offsets) or 1-D with ``offsets`` (one per bag, or one
    more with ``include_last_offset``); modes ``"sum"``, ``"mean"`` and ``"max"``;
    ``per_sample_weights`` with ``"sum"``; ``padding_idx``'s ids left out of their bags (a
    bag of them alone pools to zeros, and that row gets no gradient); ``scale_grad_by_freq``
    scales a row's gradient by the inverse of its count in the batch. ``max_norm`` is
    refused: PyTorch renormalizes the looked-up rows of the table in place, and this table
    lives on the ps. ``sparse``, ``device`` are accepted: the gradient is always the rows
    looked up, and pooling runs on this process's CPU."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mode: str = "mean",
        initializer: Initializer | None = None,
        name: str = "embedding_bag",
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if mode not in _MODES + ("max",):
            raise InvalidArgumentError(f"EmbeddingBag mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if max_norm is not None:
            raise InvalidArgumentError(
                "EmbeddingBag: max_norm is not supported (PyTorch renormalizes the table's rows in "
                "place; this table lives on the ps): clip the rows in the model instead"
            )
        if scale_grad_by_freq and mode == "max":
            raise InvalidArgumentError("EmbeddingBag: scale_grad_by_freq does not go with mode 'max'")
        self.mode = mode
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise InvalidArgumentError(
                    f"EmbeddingBag: padding_idx must be within num_embeddings ({self.num_embeddings}), "
                    f"got {padding_idx}"
                )
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.include_last_offset = bool(include_last_offset)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.sparse = bool(sparse)
        table_dtype = np.float32 if dtype is None else _numpy_dtype(dtype)
        self.table = Variable(
            initializer or RandomUniform(-0.05, 0.05),
            shape=(num_embeddings, embedding_dim),
            dtype=table_dtype,
            name=name,
        )
        self._fetched: FetchedBatches[_BagFetch] = FetchedBatches()
        register_view(self, {("table",): self.table})  # a checkpoint of it saves its table

    @property
    def rows(self) -> torch.Tensor | None:
        """The distinct rows of the last forward pass's bags (else of the last fetch), as a
        leaf tensor (with a zero row after them when ``padding_idx`` came up)."""
        state = self._fetched.current or self._fetched.latest
        return None if state is None else state.rows

    def _jagged_of(self, input: Any, offsets: Any, per_sample_weights: Any) -> JaggedTensor:  # noqa: A002
        ids = input.numpy() if isinstance(input, torch.Tensor) else np.asarray(input)
        w = (
            None
            if per_sample_weights is None
            else (
                per_sample_weights.detach().numpy()
                if isinstance(per_sample_weights, torch.Tensor)
                else np.asarray(per_sample_weights)
            )
        )
        if ids.ndim == 2:
            if offsets is not None:
                raise InvalidArgumentError("EmbeddingBag: a 2-D input takes no offsets")
            return JaggedTensor.from_dense(ids, w)
        if ids.ndim != 1:
            raise InvalidArgumentError(f"EmbeddingBag: input must be 1-D or 2-D, got shape {ids.shape}")
        if offsets is None:
            raise InvalidArgumentError("EmbeddingBag: a 1-D input needs offsets")
        o = (offsets.numpy() if isinstance(offsets, torch.Tensor) else np.asarray(offsets)).reshape(-1)
        if self.include_last_offset:
            if o.size == 0 or int(o[-1]) != ids.size:
                raise InvalidArgumentError(
                    f"EmbeddingBag(include_last_offset=True): the last offset must be the input's "
                    f"length {ids.size}, got {o[-1] if o.size else 'no offsets'}"
                )
            full = o
        else:
            full = np.r_[o, ids.size]
        return JaggedTensor(ids, offsets=full, weights=None if w is None else w.reshape(-1))

    async def fetch(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> None:  # noqa: A002
        """Gather the rows of the bags' ids (deduplicated; ``padding_idx`` never read) from
        the table's shards."""
        jagged = self._jagged_of(input, offsets, per_sample_weights)
        values = jagged.values
        padded = None if self.padding_idx is None else values == self.padding_idx
        if padded is not None and padded.any():
            unique, kept_inverse = distinct(values[~padded], sorted=True)
            inverse = np.empty(values.size, np.int64)
            inverse[~padded] = kept_inverse
            inverse[padded] = unique.size  # a zero row after the fetched ones
            rows = np.asarray(await embedding_lookup(self.table, unique))
            rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])
            padding_row: int | None = int(unique.size)
        else:
            unique, inverse = distinct(values, sorted=True)
            rows = np.asarray(await embedding_lookup(self.table, unique))
            padding_row = None
        self._fetched.add(
            _BagFetch(
                jagged, unique, inverse, padding_row, torch.from_numpy(writable(rows)).requires_grad_(True)
            )
        )

    def forward(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> torch.Tensor:  # noqa: A002
        if not self._fetched:
            raise InvalidArgumentError("EmbeddingBag: fetch the bags before forward")
        if per_sample_weights is not None and self.mode != "sum":
            raise InvalidArgumentError(
                "EmbeddingBag: per_sample_weights go only with mode 'sum' (as nn.EmbeddingBag)"
            )
        jagged = self._jagged_of(input, offsets, None)
        state = self._fetched.take(
            lambda s: (
                np.array_equal(jagged.values, s.jagged.values)
                and np.array_equal(jagged.offsets, s.jagged.offsets)
            )
        )
        if state is None:
            raise InvalidArgumentError("EmbeddingBag: forward got other bags than were fetched")
        weights = (
            per_sample_weights
            if isinstance(per_sample_weights, torch.Tensor) or per_sample_weights is None
            else torch.as_tensor(np.asarray(per_sample_weights, np.float32))
        )
        return torch.nn.functional.embedding_bag(
            torch.from_numpy(np.ascontiguousarray(state.inverse, np.int64)),
            state.rows,
            torch.from_numpy(np.ascontiguousarray(jagged.offsets[:-1], np.int64)),
            scale_grad_by_freq=self.scale_grad_by_freq,
            mode=self.mode,
            per_sample_weights=None if weights is None else weights.reshape(-1).to(state.rows.dtype),
            padding_idx=state.padding_row,
        )

    def gradient(self) -> tuple[IndexedSlices, Any] | None:
        """The gradient of the last forward pass's rows, as sparse rows of the table (None
        before backward; ``padding_idx``'s row is never among them)."""
        state = self._fetched.current
        if state is None or state.rows.grad is None:
            return None
        grad = state.rows.grad.numpy()
        if state.padding_row is not None:
            grad = grad[: state.padding_row]
        return IndexedSlices(grad, state.unique), self.table

    def extra_repr(self) -> str:
        extra = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}{extra}"


def _numpy_dtype(dtype: Any) -> np.dtype:
    """A table's dtype from a torch or numpy one."""
    if isinstance(dtype, torch.dtype):
        dtype = torch.empty(0, dtype=dtype).numpy().dtype
    out = np.dtype(dtype)
    if out.kind != "f":
        raise InvalidArgumentError(f"EmbeddingBag: dtype must be a float type, got {dtype}")
    return out


expose(globals(), "pstrain.torch")
