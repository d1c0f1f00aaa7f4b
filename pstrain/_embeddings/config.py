"""One embedding table's description: rows, width, features, combiner, initializer and
optimizer (what :class:`~pstrain.EmbeddingCollection` and its planner take)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.numerics.initializers import Initializer, RandomUniform
from .._training.optimizers import Optimizer
from .pooling import check_combiner

__all__ = ["TableConfig"]


class TableConfig:
    """One table: ``num_embeddings`` rows (None: a dynamic table keyed by raw ids) of
    ``embedding_dim`` numbers, looked up by ``feature_names``, each feature's bag pooled by
    ``combiner`` (``"sum"``, ``"mean"``, ``"sqrtn"``). ``initializer``: default uniform in
    [-0.05, 0.05] (Keras' embeddings'); ``optimizer``: this table's own, else the one
    given to :meth:`EmbeddingCollection.apply_gradients`; ``pooling_factor``: the ids a
    feature's bag holds on average (the planner's expected lookups)."""

    __slots__ = (
        "name",
        "num_embeddings",
        "embedding_dim",
        "feature_names",
        "combiner",
        "initializer",
        "optimizer",
        "dtype",
        "pooling_factor",
    )

    def __init__(
        self,
        name: str,
        num_embeddings: int | None,
        embedding_dim: int,
        feature_names: Sequence[str] | None = None,
        combiner: str = "sum",
        initializer: Initializer | None = None,
        optimizer: Any = None,
        dtype: Any = np.float32,
        pooling_factor: float = 1.0,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"TableConfig: name must be a non-empty string, got {name!r}")
        if num_embeddings is not None and (
            isinstance(num_embeddings, bool)
            or not isinstance(num_embeddings, (int, np.integer))
            or num_embeddings < 1
        ):
            raise InvalidArgumentError(
                f"table {name!r}: num_embeddings must be a positive integer "
                f"(or None: a dynamic table), got {num_embeddings!r}"
            )
        if (
            isinstance(embedding_dim, bool)
            or not isinstance(embedding_dim, (int, np.integer))
            or embedding_dim < 1
        ):
            raise InvalidArgumentError(
                f"table {name!r}: embedding_dim must be a positive integer, got {embedding_dim!r}"
            )
        if isinstance(feature_names, str):
            raise InvalidArgumentError(
                f"table {name!r}: feature_names is a list of names, got the string {feature_names!r}"
            )
        self.name = name
        self.num_embeddings = None if num_embeddings is None else int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.feature_names = list(feature_names) if feature_names is not None else [name]
        if not self.feature_names:
            raise InvalidArgumentError(f"table {name!r}: no feature looks it up")
        if not all(isinstance(f, str) and f for f in self.feature_names):
            raise InvalidArgumentError(
                f"table {name!r}: feature_names must be non-empty strings, got {self.feature_names!r}"
            )
        if len(set(self.feature_names)) != len(self.feature_names):
            raise InvalidArgumentError(f"table {name!r}: feature_names repeat: {self.feature_names!r}")
        self.combiner = check_combiner(combiner)
        self.initializer = initializer if initializer is not None else RandomUniform(-0.05, 0.05)
        if not isinstance(self.initializer, Initializer):
            raise InvalidArgumentError(
                f"table {name!r}: initializer must be a pstrain initializer, "
                f"got {type(self.initializer).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise InvalidArgumentError(
                f"table {name!r}: optimizer must be a pstrain optimizer (pstrain.optimizers."
                f"Adagrad(0.05) ...) or None (the one apply_gradients is given), got {optimizer!r}"
            )
        self.optimizer = optimizer
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise InvalidArgumentError(f"table {name!r}: dtype must be a float type, got {self.dtype}")
        if not pooling_factor > 0:
            raise InvalidArgumentError(f"table {name!r}: pooling_factor must be positive")
        self.pooling_factor = float(pooling_factor)

    def __repr__(self) -> str:
        rows = "dynamic" if self.num_embeddings is None else self.num_embeddings
        return (
            f"TableConfig({self.name!r}, {rows}, {self.embedding_dim}, "
            f"features={self.feature_names}, combiner={self.combiner!r})"
        )


expose(globals(), "pstrain")
