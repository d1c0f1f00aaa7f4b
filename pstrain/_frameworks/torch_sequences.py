"""Unpooled embeddings for PyTorch models: TorchRec's ``EmbeddingCollection`` with its
tables on the ps, for sequence features (a user's last clicks, a query's terms) that a
model attends over instead of pooling.

::

    import pstrain.torch as ptorch

    with strategy.scope():
        ec = ptorch.EmbeddingCollection(tables)       # EmbeddingConfigs (TorchRec's or ptorch's)

    async def step(iterator):
        kjt, dense, y = next(iterator)                # a pstrain.KeyedJaggedTensor
        await ec.pull(kjt)                            # one request per ps, every table
        seqs = ec(kjt)                                # {feature: ptorch.JaggedTensor}
        history = seqs["clicks"].to_padded_dense(50)  # [batch, 50, dim]
        loss = ...
        loss.backward()
        await optimizer.apply_gradients(ec.gradients())

Each feature's output holds a row per id, in the batch's order (``values()``,
``[ids, dim]``), with the feature's ``lengths()``: ``nn.Embedding`` over the batch's
distinct rows (a leaf tensor), so the gradients are PyTorch's own and go back as
:class:`~pstrain.IndexedSlices` over the distinct ids. As TorchRec's: every table has the
same ``embedding_dim``, the batch's per-id weights are ignored, ``need_indices=True`` puts
each feature's ids in its output's ``weights()``, and float16 tables give float32 rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._embeddings.jagged import JaggedTensor as _Bags, KeyedJaggedTensor
from .fetched import writable
from .torch_pulled import PulledCollection
from .torchrec_configs import table_configs

__all__ = ["EmbeddingCollection", "JaggedTensor"]


def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(x)))
    return out if dtype is None else out.to(dtype)


class JaggedTensor:
    """TorchRec's ``JaggedTensor`` over torch tensors, what
    :class:`EmbeddingCollection` returns per feature: ``values()`` (a row per id, or the ids),
    with ``lengths()`` or ``offsets()`` saying which belong to which example, and optional
    ``weights()``. (``pstrain.JaggedTensor`` is the numpy batch of bags a dataset makes.)"""

    def __init__(self, values: Any, weights: Any = None, lengths: Any = None, offsets: Any = None) -> None:
        self._values = _tensor(values)
        self._weights = None if weights is None else _tensor(weights)
        if lengths is None and offsets is None:
            raise InvalidArgumentError("JaggedTensor: give lengths or offsets")
        self._lengths = None if lengths is None else _tensor(lengths).reshape(-1)
        self._offsets = None if offsets is None else _tensor(offsets).reshape(-1)
        n = int(self._values.shape[0]) if self._values.dim() else 0
        ends = self.offsets()
        if ends.numel() == 0 or int(ends[0]) != 0 or int(ends[-1]) != n or bool((ends.diff() < 0).any()):
            raise InvalidArgumentError(
                f"JaggedTensor: the lengths or offsets do not split {n} values into bags"
            )
        if self._lengths is not None and self._offsets is not None:
            if not torch.equal(self._lengths.to(torch.int64), ends.diff()):
                raise InvalidArgumentError("JaggedTensor: the lengths and offsets disagree")
        if self._weights is not None and self._weights.shape[0] != n:
            raise InvalidArgumentError(f"JaggedTensor: {self._weights.shape[0]} weights for {n} values")

    def values(self) -> torch.Tensor:
        """The values of every example, end to end (rows: ``[ids, dim]``)."""
        return self._values

    def weights(self) -> torch.Tensor:
        """One weight per value (an ``EmbeddingCollection(need_indices=True)``'s: the ids);
        refused if there are none."""
        if self._weights is None:
            raise InvalidArgumentError("JaggedTensor: it has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        """:meth:`weights`, or None."""
        return self._weights

    def lengths(self) -> torch.Tensor:
        """Each example's number of values."""
        if self._lengths is None:
            assert self._offsets is not None
            self._lengths = self._offsets.diff()
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        """The lengths given (or worked out so far), or None."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Where each example's values start, then the end (one more than the examples)."""
        if self._offsets is None:
            assert self._lengths is not None
            lengths = self._lengths.to(torch.int64)
            self._offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        """The offsets given (or worked out so far), or None."""
        return self._offsets

    def __len__(self) -> int:
        """The number of examples (bags)."""
        return int(self.offsets().numel()) - 1

    def to_dense(self) -> list[torch.Tensor]:
        """Each example's values (views of :meth:`values`)."""
        ends = self.offsets().tolist()
        return [self._values[ends[i] : ends[i + 1]] for i in range(len(ends) - 1)]

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        """Each example's weights (None without weights)."""
        if self._weights is None:
            return None
        ends = self.offsets().tolist()
        return [self._weights[ends[i] : ends[i + 1]] for i in range(len(ends) - 1)]

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[examples, N, ...]``: each example's values, cut to ``N`` (``desired_length``, or
        the longest example's) or padded with ``padding_value``, as TorchRec's (gradients
        flow back through it)."""
        return _padded(self._values, self.offsets(), desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        """:meth:`to_padded_dense` of the weights (None without weights)."""
        if self._weights is None:
            return None
        return _padded(self._weights, self.offsets(), desired_length, padding_value)

    def to(self, device: Any = None, non_blocking: bool = False) -> JaggedTensor:
        """TorchRec's: itself (its tensors stay on the CPU, where the worker pools)."""
        return self

    def device(self) -> torch.device:
        """Where the values are: the CPU."""
        return self._values.device

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, examples={len(self)})"


def _padded(values: torch.Tensor, offsets: torch.Tensor, n: int | None, padding: float) -> torch.Tensor:
    lengths = offsets.diff()
    if n is None:
        n = int(lengths.max()) if lengths.numel() else 0
    if n < 0:
        raise InvalidArgumentError(f"to_padded_dense: desired_length must be 0 or more, got {n}")
    batch = int(lengths.numel())
    out = values.new_full((batch, n, *values.shape[1:]), padding)
    # every kept value's place: example b, position p < min(length, n)
    position = torch.arange(values.shape[0]) - torch.repeat_interleave(offsets[:-1], lengths)
    example = torch.repeat_interleave(torch.arange(batch), lengths)
    kept = position < n
    out[example[kept], position[kept]] = values[kept]  # (differentiable: an index_put)
    return out


class EmbeddingCollection(PulledCollection):
    """TorchRec's ``EmbeddingCollection`` on the ps: the tables of a
    :class:`~pstrain.EmbeddingCollection` (placed by its planner), looked up unpooled.
    Create it in ``strategy.scope()``; ``tables`` are TorchRec ``EmbeddingConfig``\\ s (an
    ``EmbeddingBagConfig``'s pooling is ignored, as TorchRec does) or
    :class:`~pstrain.TableConfig`\\ s (their combiner unused), all of one ``embedding_dim``.
    ``device`` and ``use_gather_select`` are TorchRec's, accepted and unused (the rows are
    indexed on this process's CPU). A feature may look up one table (TorchRec names a
    feature shared by two tables ``feature@table``; that is refused here)."""

    _tables_at = "embeddings"  # (TorchRec's: embeddings.<table>.weight)

    def __init__(
        self,
        tables: Sequence[Any],
        device: Any = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        *,
        shard_rows: int | None = None,
        name: str = "embeddings",
    ) -> None:
        configs = table_configs(list(tables), pooled=False)
        dims = [c.embedding_dim for c in configs]
        if dims and any(d != dims[0] for d in dims):
            odd = next(c for c in configs if c.embedding_dim != dims[0])
            raise InvalidArgumentError(
                "EmbeddingCollection: every table must have the same embedding_dim (as TorchRec's): "
                f"table {odd.name!r} has {odd.embedding_dim}, the first {dims[0]}"
            )
        super().__init__(configs, shard_rows, name)
        self._configs = list(tables)
        self._need_indices = bool(need_indices)

    def embedding_configs(self) -> list[Any]:
        """The table configs as given."""
        return list(self._configs)

    def embedding_dim(self) -> int:
        """The tables' (one) row width."""
        return next(iter(self.collection.configs.values())).embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output names: its features'."""
        return [list(c.feature_names) for c in self.collection.configs.values()]

    def need_indices(self) -> bool:
        """TorchRec's: whether each output carries its feature's ids as ``weights()``."""
        return self._need_indices

    def _features(self, features: KeyedJaggedTensor | Mapping[str, Any]) -> dict[str, _Bags]:
        """The batch's features without their weights (an unpooled lookup ignores them)."""
        given = super()._features(features)
        return {f: j if j.weights is None else _Bags(j.values, offsets=j.offsets) for f, j in given.items()}

    def forward(self, features: KeyedJaggedTensor | Mapping[str, Any]) -> dict[str, JaggedTensor]:
        pulled = self._pulled_for(self._features(features))
        gathered = pulled.gathered
        out: dict[str, JaggedTensor] = {}
        for name, (_, named) in gathered.bags.items():
            for feature, bags in named:
                jagged = gathered.features[feature]
                rows = torch.nn.functional.embedding(torch.from_numpy(bags.inverse), pulled.rows[name])
                out[feature] = JaggedTensor(
                    rows.float(),
                    weights=torch.from_numpy(writable(jagged.values)) if self._need_indices else None,
                    offsets=torch.from_numpy(writable(np.ascontiguousarray(jagged.offsets, np.int64))),
                )
        return {f: out[f] for f in self.collection.feature_names}


expose(globals(), "pstrain.torch")
