"""What TorchRec's two collections on the ps share (``EmbeddingBagCollection``, which pools,
and ``EmbeddingCollection``, which does not): the tables of a
:class:`~pstrain.EmbeddingCollection`, a batch's rows pulled in one request per ps before
its forward pass (each batch in flight its own, :mod:`.fetched`), and the tables' gradients
as sparse rows after ``backward()``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._base.errors import InvalidArgumentError
from .._checkpoint.object_graph import register_view
from .._embeddings.collection import EmbeddingCollection
from .._embeddings.config import TableConfig
from .._embeddings.jagged import JaggedTensor, KeyedJaggedTensor, features_by_name
from .._variables.arrays import IndexedSlices
from .fetched import FetchedBatches, PulledRows, writable

__all__ = ["PulledCollection"]


class PulledCollection(torch.nn.Module):
    """A torch module over the tables ``configs`` (placed by the collection's planner; in
    ``strategy.scope()`` on the ps). Subclasses look the pulled rows up in ``forward``."""

    #: Where TorchRec's module keeps its tables (``embedding_bags.<table>.weight``): a
    #: checkpoint keys each table by the same path.
    _tables_at = "embedding_bags"

    def __init__(self, configs: Sequence[TableConfig], shard_rows: int | None, name: str) -> None:
        super().__init__()
        kwargs = {} if shard_rows is None else {"shard_rows": shard_rows}
        self.collection = EmbeddingCollection(configs, name=name, **kwargs)
        self._pulled: FetchedBatches[PulledRows] = FetchedBatches()
        # a checkpoint of this module (or of a model holding it, through its RemoteModule)
        # saves the tables, keyed as TorchRec's state_dict keys them, and the optimizers
        # tables name themselves (pstrain TableConfigs), as the collection's checkpoint does
        view: dict[tuple[str, ...], Any] = {
            (self._tables_at, t, "weight"): v for t, v in self.collection.tables.items()
        }
        view.update({("optimizers", t): o for t, o in self.collection.optimizers.items()})
        register_view(self, view)

    @property
    def plan(self) -> Any:
        return self.collection.plan

    def _features(self, features: KeyedJaggedTensor | Mapping[str, Any]) -> dict[str, JaggedTensor]:
        """The batch's features by name, as the lookup takes them."""
        return features_by_name(features, type(self).__name__)

    async def pull(
        self,
        features: KeyedJaggedTensor | Mapping[str, Any],
        *,
        read: Iterable[Any] = (),
        training: bool = True,
    ) -> list[np.ndarray]:
        """Gather every table's rows for the batch (and the variables ``read``, whole): one
        request per ps. Returns ``read``'s values. Steps in flight on one worker may each
        pull their batch: the forward pass takes the rows pulled for its own."""
        gathered = await self.collection.gather(self._features(features), read=read, training=training)
        rows = {
            name: torch.from_numpy(writable(values)).requires_grad_(True)
            for name, values in gathered.rows.items()
        }
        self._pulled.add(PulledRows(gathered, rows))
        return gathered.read

    def _pulled_for(self, given: dict[str, JaggedTensor]) -> PulledRows:
        """The rows pulled for the batch of features ``given``."""
        what = type(self).__name__
        latest = self._pulled.latest
        if latest is None:
            raise InvalidArgumentError(f"{what}: pull the batch before forward")
        pulled = self._pulled.take(lambda p: p.holds(given))
        if pulled is None:
            missing = sorted(set(latest.gathered.features) - set(given))
            raise InvalidArgumentError(
                f"{what}: forward got other features than were pulled"
                + (f" (no {missing})" if missing else "")
                + ": pull each batch before its forward pass"
            )
        return pulled

    def gradients(self) -> list[tuple[IndexedSlices, Any]]:
        """``[(gradient, table), ...]`` after ``backward()``: each table's distinct rows', for
        the batch of the last forward pass (take them before the step awaits again)."""
        pulled = self._pulled.current
        if pulled is None:
            return []
        out = []
        for name, rows in pulled.rows.items():
            if rows.grad is not None:
                unique = pulled.gathered.bags[name][0]
                out.append((IndexedSlices(rows.grad.numpy(), unique), self.collection.tables[name]))
        return out

    def trainable_variables(self) -> list[Any]:
        """The tables."""
        return list(self.collection.tables.values())
