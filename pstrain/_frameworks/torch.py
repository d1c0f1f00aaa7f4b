"""PyTorch modules whose parameters live on the ps; autograd computes every gradient.

::

    import pstrain.torch as ptorch

    class CTR(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = ptorch.Embedding(1_000_000, 16)      # a (sharded) table on the ps
            self.mlp = torch.nn.Sequential(torch.nn.Linear(429, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def forward(self, ids, dense):
            return self.mlp(torch.cat([self.emb(ids).flatten(1), dense], 1))[:, 0]

    with strategy.scope():
        net = CTR()
        remote = ptorch.RemoteModule(net)             # a ps variable per parameter
        opt = pstrain.optimizers.Adagrad(0.05)

    async def step(iterator):                         # scheduled on a worker
        ids, dense, y = next(iterator)
        await remote.pull({net.emb: ids})             # parameters and the batch's rows
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(ids, dense), y)
        loss.backward()
        await opt.apply_gradients(remote.gradients())
        return loss.item()

* :meth:`RemoteModule.pull` reads every parameter in one request per ps and
  puts it into the module with ``torch.from_numpy`` (no copy), and gathers,
  for each :class:`Embedding`, only the rows of the batch's unique ids.
* :class:`Embedding`'s forward returns those rows as a leaf tensor indexed by
  the batch's ids; its gradient (duplicates summed by autograd) goes back as
  :class:`~pstrain.IndexedSlices` over the unique ids: only looked-up rows
  travel, both ways.
* :meth:`RemoteModule.gradients` is ``[(grad, variable), ...]`` for
  ``optimizer.apply_gradients``; the update rule runs on the ps.
* A module holds one step's state (its parameters, the fetched rows). With
  several closures in flight per worker, take a module of your own for each
  step: ``async with remote.replica({"emb": ids}) as net:`` pulls into a copy
  from a per-process pool (grown to the number of steps running at once), and
  ``remote.gradients(net)`` reads that copy's gradients.

Needs the ``torch`` extra: ``pip install 'pstrain[torch]'``. Several processes on
one machine (``LocalCluster``, ``pstrain launch``) get ``OMP_NUM_THREADS`` set
so that each sizes its intra-op thread pool to its share of the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import numpy as np

from .._base.exports import expose

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("pstrain.torch needs PyTorch: pip install 'pstrain[torch]'") from exc

from .._base.errors import InvalidArgumentError
from .._checkpoint.object_graph import register_view, registered_view
from .._formats.numerics.initializers import Initializer, RandomUniform
from .._kernels.batches import distinct
from .._variables.arrays import IndexedSlices
from .._variables.batched import read_variables
from .._variables.dynamic import DynamicEmbedding
from .._variables.sharding import ShardedVariable, combine_gradients, embedding_lookup
from .._variables.variables import Variable
from .fetched import FetchedBatches, writable
from .torch_bags import EmbeddingBag
from .torch_pulled import PulledCollection

__all__ = ["Embedding", "RemoteModule"]


class _Fetch:
    """One batch's fetch: its ids, their distinct ids and where each id is among them, each
    distinct id's count (``scale_grad_by_freq``), and their rows as a leaf tensor."""

    __slots__ = ("ids", "unique", "inverse", "counts", "rows")

    def __init__(
        self,
        ids: np.ndarray,
        unique: np.ndarray,
        inverse: torch.Tensor,
        counts: np.ndarray | None,
        rows: torch.Tensor,
    ) -> None:
        self.ids, self.unique, self.inverse, self.counts, self.rows = ids, unique, inverse, counts, rows


class Embedding(torch.nn.Module):
    """An embedding table on the ps (sharded by the strategy's partitioner); create it in
    ``strategy.scope()``. Before a forward pass, :meth:`RemoteModule.pull` (or
    :meth:`fetch`) gathers the batch's rows; ``forward(ids)`` returns them as
    ``ids.shape + (embedding_dim,)``.

    As ``nn.Embedding``: ``padding_idx``'s id gives zeros and its row gets no gradient (it
    is never read: a new ``nn.Embedding``'s padding row is zeros, and stays so);
    ``scale_grad_by_freq`` scales a row's gradient by the inverse of its count in the batch.
    ``max_norm`` is refused (PyTorch renormalizes the table's rows in place; this table
    lives on the ps). ``sparse`` is accepted: the gradient is always the rows looked up."""

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        initializer: Initializer | None = None,
        name: str = "embedding",
        *,
        table: DynamicEmbedding | None = None,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        if max_norm is not None:
            raise InvalidArgumentError(
                "Embedding: max_norm is not supported (PyTorch renormalizes the table's rows in "
                "place; this table lives on the ps): clip the rows in the model instead"
            )
        self.table: Variable | ShardedVariable | DynamicEmbedding
        if table is not None:  # rows keyed by raw ids: no fixed number of rows
            if not isinstance(table, DynamicEmbedding) or table.dim != embedding_dim:
                raise InvalidArgumentError(
                    f"Embedding(table=...) takes a DynamicEmbedding {embedding_dim} wide"
                )
            self.num_embeddings, self.embedding_dim = None, int(embedding_dim)
            self.table = table
        else:
            if num_embeddings is None or num_embeddings < 1 or embedding_dim < 1:
                raise InvalidArgumentError("Embedding needs positive num_embeddings and embedding_dim")
            self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
            self.table = Variable(
                initializer or RandomUniform(-0.05, 0.05),
                shape=(num_embeddings, embedding_dim),
                dtype=np.float32,
                name=name,
            )
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            n = self.num_embeddings
            if n is not None:  # (a dynamic table's padding id is any id, as given)
                if not -n <= padding_idx < n:
                    raise InvalidArgumentError(
                        f"Embedding: padding_idx must be within num_embeddings ({n}), got {padding_idx}"
                    )
                padding_idx %= n
        self.padding_idx = padding_idx
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.sparse = bool(sparse)
        self._fetched: FetchedBatches[_Fetch] = FetchedBatches()
        register_view(self, {("table",): self.table})  # a checkpoint of it saves its table

    @property
    def rows(self) -> torch.Tensor | None:
        """The distinct rows of the last forward pass's batch (else of the last fetch), as
        a leaf tensor: after ``backward()``, their gradient is ``rows.grad``."""
        state = self._fetched.current or self._fetched.latest
        return None if state is None else state.rows

    async def fetch(self, ids: Any, *, training: bool = True) -> None:
        """Gather the rows of ``ids`` (deduplicated; ``padding_idx`` never read) from the
        table's shards. ``training=False`` (evaluation, serving): a dynamic table admits
        nothing."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"embedding ids must be integers, got {ids.dtype}")
        unique, inverse = distinct(ids.reshape(-1), sorted=True)
        if self.padding_idx is None:
            rows = await embedding_lookup(self.table, unique, training=training)
        else:
            real = unique != self.padding_idx
            rows = np.zeros((unique.size, self.embedding_dim), np.float32)
            if real.any():
                rows[real] = await embedding_lookup(self.table, unique[real], training=training)
        self._set(ids, unique, inverse, rows)

    def _set(self, ids: np.ndarray, unique: np.ndarray, inverse: np.ndarray, rows: np.ndarray) -> None:
        counts = np.bincount(inverse.reshape(-1), minlength=unique.size) if self.scale_grad_by_freq else None
        self._fetched.add(
            _Fetch(
                ids,
                unique,
                torch.from_numpy(inverse.reshape(ids.shape).astype(np.int64)),
                counts,
                torch.from_numpy(writable(rows)).requires_grad_(True),
            )
        )

    def forward(self, ids: Any) -> torch.Tensor:
        if not self._fetched:
            raise InvalidArgumentError("Embedding: pull (or fetch) the batch's ids before forward")
        given = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        state = self._fetched.take(
            lambda s: given.shape == s.ids.shape and (given is s.ids or np.array_equal(given, s.ids))
        )
        if state is None:
            raise InvalidArgumentError("Embedding: forward got other ids than were fetched")
        return state.rows[state.inverse]

    def gradient(self) -> tuple[IndexedSlices, Variable | ShardedVariable | DynamicEmbedding] | None:
        """The gradient of the last forward pass's rows, as sparse rows of the table (None
        before backward; ``padding_idx``'s row is never among them)."""
        state = self._fetched.current
        if state is None or state.rows.grad is None:
            return None
        grad, unique = state.rows.grad.numpy(), state.unique
        if state.counts is not None:
            grad = grad / state.counts[:, None].astype(grad.dtype)
        if self.padding_idx is not None:
            real = unique != self.padding_idx
            grad, unique = grad[real], unique[real]
        return IndexedSlices(grad, unique), self.table

    def extra_repr(self) -> str:
        extra = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table.name!r}{extra}"


class RemoteModule:
    """The parameters of a ``torch.nn.Module`` as ps variables (one per parameter, named by
    its path); create it in ``strategy.scope()``, capture it in closures."""

    def __init__(self, module: torch.nn.Module, name: str = "model") -> None:
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(f"RemoteModule needs a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.names: list[str] = []
        self.variables: list[Variable | ShardedVariable] = []
        for pname, param in module.named_parameters():
            self.names.append(pname)
            self.variables.append(
                Variable(
                    param.detach().cpu().numpy().copy(), name=f"{name}/{pname}", trainable=param.requires_grad
                )
            )
        self._spare: list[torch.nn.Module] = []  # replicas not in use (per process)
        # Checkpoints key each parameter by its path in the module (tower/0/weight), whether
        # given the module or this RemoteModule: never by position.
        view: dict[tuple[str, ...], Any] = {
            tuple(p.split(".")): v for p, v in zip(self.names, self.variables)
        }
        for mname, sub in module.named_modules():  # the tables of its pstrain.torch modules
            if sub is not module and isinstance(sub, (Embedding, EmbeddingBag, PulledCollection)):
                for path, table in (registered_view(sub) or {}).items():
                    view[(*(mname.split(".") if mname else []), *path)] = table
        register_view(self, view)
        register_view(module, view)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_spare"] = []  # replicas are built where they are used
        return state

    def _embeddings(self, module: torch.nn.Module) -> dict[str, Embedding]:
        return {n: m for n, m in module.named_modules() if isinstance(m, Embedding)}

    def _parameters(self, module: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
        params = dict(module.named_parameters())
        for pname in self.names:
            yield params[pname]

    async def pull(
        self,
        lookups: Mapping[Embedding | str, Any] | None = None,
        module: torch.nn.Module | None = None,
        *,
        training: bool = True,
    ) -> None:
        """Fill the module's parameters from the ps, and gather each embedding's rows for
        its ids (keyed by the Embedding or its name in the module), all concurrently (one
        request per ps for the parameters). ``module``: a replica instead of the module.
        ``training=False`` for evaluation and serving: dynamic tables admit no id."""
        target = self.module if module is None else module
        embeddings = self._embeddings(target)
        fetches = []
        template = self._embeddings(self.module)
        for key, ids in (lookups or {}).items():
            name = key if isinstance(key, str) else next((n for n, m in template.items() if m is key), None)
            if name not in embeddings:
                raise InvalidArgumentError(f"pull: {key!r} is not a pstrain.torch.Embedding of the module")
            fetches.append(embeddings[name].fetch(ids, training=training))
        values, *_ = await asyncio.gather(read_variables(self.variables), *fetches)
        with torch.no_grad():
            for param, value in zip(self._parameters(target), values):
                param.data = torch.from_numpy(writable(np.asarray(value)))  # no copy
                param.grad = None

    @contextlib.asynccontextmanager
    async def replica(
        self, lookups: Mapping[Embedding | str, Any] | None = None, *, training: bool = True
    ) -> AsyncIterator[torch.nn.Module]:
        """A copy of the module of this step's own, pulled (see :meth:`pull`); back to the
        pool after the block. For several steps in flight on one worker."""
        module = self._spare.pop() if self._spare else copy.deepcopy(self.module)
        try:
            await self.pull(lookups, module, training=training)
            yield module
        finally:
            self._spare.append(module)

    def gradients(self, module: torch.nn.Module | None = None) -> list[tuple[Any, Any]]:
        """``[(gradient, variable), ...]`` after ``backward()``: dense parameters and the
        rows of its :class:`Embedding`\\ s (as IndexedSlices), for
        ``optimizer.apply_gradients``. Embeddings that share one table give one combined
        gradient. The tables of an ``EmbeddingBag`` or of TorchRec's collections in the
        module are not among them: each gives its own (``bag.gradient()``,
        ``ebc.gradients()``), pulled and applied beside these."""
        target = self.module if module is None else module
        out: list[tuple[Any, Any]] = []
        for param, var in zip(self._parameters(target), self.variables):
            if param.grad is not None:
                out.append((param.grad.numpy(), var))
        for emb in self._embeddings(target).values():
            g = emb.gradient()
            if g is not None:
                out.append(g)
        return combine_gradients(out)

    def trainable_variables(self) -> list[Variable | ShardedVariable | DynamicEmbedding]:
        """The ps variables: the parameters', then each :class:`Embedding`'s table (an
        ``EmbeddingBag``'s and the collections' tables are their own modules')."""
        return [*self.variables, *(emb.table for emb in self._embeddings(self.module).values())]


expose(globals(), "pstrain.torch")
