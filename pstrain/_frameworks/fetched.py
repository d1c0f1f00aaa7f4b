"""The rows a module fetched from the ps for a batch, kept per batch until its forward pass.

A PyTorch module whose table lives on the ps gathers a batch's rows before the forward
pass (``fetch`` or ``pull``), and the forward pass pools or indexes them. With several
steps in flight on one worker, the next step may fetch its batch before this one runs
forward: each fetched batch keeps its own rows, and the forward pass takes the rows of
the batch it is given. The gradients are those of the last forward pass, which a step
takes before it awaits again (``await optimizer.apply_gradients(module.gradients())``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

    from .._embeddings.collection import GatheredRows
    from .._embeddings.jagged import JaggedTensor

S = TypeVar("S")

#: Batches kept fetched and not yet run forward (steps in flight on a worker), oldest dropped.
MAX_WAITING = 8


def writable(array: np.ndarray) -> np.ndarray:
    """``array``, or a copy if it is read-only (``torch.from_numpy`` needs it writable)."""
    return array if array.flags.writeable else array.copy()


class FetchedBatches(Generic[S]):
    """The states of the batches fetched and not yet run forward (``waiting``, newest
    last), and the state of the last forward pass (``current``)."""

    __slots__ = ("waiting", "current")

    def __init__(self) -> None:
        self.waiting: list[S] = []
        self.current: S | None = None

    def add(self, state: S) -> None:
        """A batch was fetched."""
        self.waiting.append(state)
        del self.waiting[:-MAX_WAITING]

    def take(self, holds: Callable[[S], bool]) -> S | None:
        """The state of the batch a forward pass was given (``holds`` says whether a state
        is of it): the newest such fetch, which becomes :attr:`current`, else the current one
        if it is of it (a second forward pass of the same batch), else None."""
        for state in reversed(self.waiting):
            if holds(state):
                self.waiting.remove(state)
                self.current = state
                return state
        if self.current is not None and holds(self.current):
            return self.current
        return None

    @property
    def latest(self) -> S | None:
        """The newest state: the last fetch not yet run forward, else the current one."""
        return self.waiting[-1] if self.waiting else self.current

    def __bool__(self) -> bool:
        return bool(self.waiting) or self.current is not None


class PulledRows:
    """One batch a collection pulled (``EmbeddingBagCollection``, ``EmbeddingCollection``):
    its gathered rows, and them as leaf tensors for autograd."""

    __slots__ = ("gathered", "rows")

    def __init__(self, gathered: GatheredRows, rows: dict[str, torch.Tensor]) -> None:
        self.gathered, self.rows = gathered, rows

    def holds(self, given: dict[str, JaggedTensor]) -> bool:
        """Whether ``given`` are the features pulled (the same objects, or equal ones)."""
        features = self.gathered.features
        return all(f in given and (given[f] is features[f] or given[f] == features[f]) for f in features)
