"""TorchRec's DLRM, DLRM-DCN (MLPerf's DLRM-DCNv2) and their parts (``torchrec.models.dlrm``,
``torchrec.modules.mlp``, ``torchrec.modules.crossnet``'s ``LowRankCrossNet``) over
:class:`~pstrain.torch.EmbeddingBagCollection`: a TorchRec program's model ports with its
import changed, its dense parameters under the same names (a TorchRec ``state_dict``'s
dense entries load as they are), and one line added to its step, the pull of the batch's
rows before the forward pass::

    import pstrain.torch as ptorch

    with strategy.scope():
        ebc = ptorch.EmbeddingBagCollection(eb_configs)
        model = ptorch.DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[512, 256, 64],
                            over_arch_layer_sizes=[512, 512, 256, 1])
        remote = ptorch.RemoteModule(model, name="dlrm")    # the dense parameters on the ps

    async def step(iterator):
        dense, kjt, labels = next(iterator)
        await asyncio.gather(ebc.pull(kjt), remote.pull())
        logits = model(torch.from_numpy(dense), kjt)
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._base.errors import InvalidArgumentError
from .._base.exports import expose

__all__ = [
    "DLRM",
    "DLRM_DCN",
    "MLP",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "LowRankCrossNet",
    "OverArch",
    "Perceptron",
    "SparseArch",
    "choose",
]


def choose(n: int, k: int) -> int:
    """The number of ways to choose ``k`` of ``n`` (0 outside ``0 <= k <= n``)."""
    if not 0 <= k <= n:
        return 0
    out = 1
    for i in range(min(k, n - k)):
        out = out * (n - i) // (i + 1)
    return out


class Perceptron(nn.Module):
    """TorchRec's ``Perceptron``: a linear layer, then ``activation``."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        device: Any = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size, self._out_size = in_size, out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - TorchRec's name
        return self._activation_fn(self._linear(input))


class MLP(nn.Module):
    """TorchRec's ``MLP``: a :class:`Perceptron` per layer size, each followed by
    ``activation`` (``"relu"``, ``"sigmoid"``, a module or a function; the last layer's
    too unless ``activation_on_last=False``). TorchRec's ``"swish_layernorm"`` is refused
    by name."""

    def __init__(
        self,
        in_size: int,
        layer_sizes: list[int],
        bias: bool = True,
        activation: str | nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        device: Any = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(activation, str):
            named = {"relu": torch.relu, "sigmoid": torch.sigmoid}
            if activation not in named:
                raise InvalidArgumentError(
                    f"MLP: activation {activation!r} is not one of {sorted(named)} (TorchRec's "
                    "'swish_layernorm' is not here: give the module itself)"
                )
            activation = named[activation]
        sizes = [in_size, *layer_sizes]
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    sizes[i],
                    sizes[i + 1],
                    bias=bias,
                    activation=nn.Identity()
                    if i == len(layer_sizes) - 1 and not activation_on_last
                    else activation,
                    dtype=dtype,
                )
                for i in range(len(layer_sizes))
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - TorchRec's name
        return self._mlp(input)


class SparseArch(nn.Module):
    """TorchRec's ``SparseArch``: the collection's pooled rows as ``[batch, features, dim]``
    (every table of one ``embedding_dim``). The batch's rows must have been pulled."""

    def __init__(self, embedding_bag_collection: Any) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise InvalidArgumentError("SparseArch: the embedding bag collection has no table")
        self.D: int = configs[0].embedding_dim
        self._sparse_feature_names = [name for c in configs for name in (c.feature_names or [c.name])]
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> list[str]:
        return list(self._sparse_feature_names)

    def forward(self, features: Any) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.cat([pooled[f] for f in self._sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """TorchRec's ``DenseArch``: an :class:`MLP` (ReLU after every layer) over the dense
    features."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: Any = None) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class InteractionArch(nn.Module):
    """TorchRec's ``InteractionArch``: the dense output beside the dot products of every pair
    among it and the pooled features (``choose(F + 1, 2)`` of them)."""

    triu_indices: torch.Tensor  # (a buffer: each pair i < j)

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.register_buffer(
            "triu_indices", torch.triu_indices(self.F + 1, self.F + 1, offset=1), persistent=False
        )

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        interactions = torch.bmm(combined, combined.transpose(1, 2))
        flat = interactions[:, self.triu_indices[0], self.triu_indices[1]]
        return torch.cat((dense_features, flat), dim=1)


class LowRankCrossNet(nn.Module):
    """TorchRec's ``LowRankCrossNet`` (DCN-v2's cross layers of rank ``low_rank``): layer
    ``l`` makes ``x0 * (W_l (V_l x) + b_l) + x``; ``W_kernels``, ``V_kernels`` and ``bias``
    as TorchRec names them (Glorot-normal kernels, zero biases)."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if low_rank < 1:
            raise InvalidArgumentError(f"LowRankCrossNet: low_rank must be 1 or more, got {low_rank}")
        self._num_layers, self._low_rank = num_layers, low_rank
        self.W_kernels = nn.ParameterList(
            [
                nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank)))
                for _ in range(num_layers)
            ]
        )
        self.V_kernels = nn.ParameterList(
            [
                nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features)))
                for _ in range(num_layers)
            ]
        )
        self.bias = nn.ParameterList([nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - TorchRec's name
        x0 = x = input
        for layer in range(self._num_layers):
            xw = nn.functional.linear(nn.functional.linear(x, self.V_kernels[layer]), self.W_kernels[layer])
            x = x0 * (xw + self.bias[layer]) + x
        return x


class InteractionDCNArch(nn.Module):
    """TorchRec's ``InteractionDCNArch``: the dense output and the pooled features side by
    side, through a cross network (:class:`LowRankCrossNet`)."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F, self.crossnet = num_sparse_features, crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape(dense_features.shape[0], -1))


class OverArch(nn.Module):
    """TorchRec's ``OverArch``: an :class:`MLP` of all but the last layer size, then a plain
    linear layer to the last (the logits)."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: Any = None) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise InvalidArgumentError("OverArch must have multiple layers.")
        self.model = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu"),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DLRM(nn.Module):
    """TorchRec's ``DLRM``: ``DenseArch`` over the dense features, ``SparseArch`` over the
    collection (its tables on the ps, all of the dense arch's last width), their pairwise
    interactions, ``OverArch`` to the logits. ``model(dense_features, sparse_features)``
    after ``await model.sparse_arch.embedding_bag_collection.pull(sparse_features)``.
    ``dense_device`` is TorchRec's, accepted and unused."""

    def __init__(
        self,
        embedding_bag_collection: Any,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: Any = None,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise InvalidArgumentError("DLRM: at least one embedding bag is required")
        dims = {c.embedding_dim for c in configs}
        if len(dims) != 1:
            raise InvalidArgumentError(
                f"DLRM: every table must have the same embedding_dim, got {sorted(dims)}"
            )
        dim = dims.pop()
        if dense_arch_layer_sizes[-1] != dim:
            raise InvalidArgumentError(
                f"DLRM: the tables' embedding_dim ({dim}) and the dense arch's last layer size "
                f"({dense_arch_layer_sizes[-1]}) must match"
            )
        self.sparse_arch = SparseArch(embedding_bag_collection)
        features = self.sparse_arch.F
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = InteractionArch(features)
        self.over_arch = OverArch(dim + choose(features, 2) + features, over_arch_layer_sizes)

    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(embedded_dense, embedded_sparse))


class DLRM_DCN(DLRM):  # noqa: N801 - TorchRec's name
    """TorchRec's ``DLRM_DCN``: :class:`DLRM` with its pairwise interactions replaced by a
    cross network of ``dcn_num_layers`` layers of rank ``dcn_low_rank_dim`` over the dense
    output and the pooled features side by side (MLPerf's DLRM-DCNv2)."""

    def __init__(
        self,
        embedding_bag_collection: Any,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: Any = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes
        )
        width = (self.sparse_arch.F + 1) * self.sparse_arch.D
        crossnet = LowRankCrossNet(width, dcn_num_layers, dcn_low_rank_dim)
        self.inter_arch = InteractionDCNArch(self.sparse_arch.F, crossnet)  # type: ignore[assignment]
        self.over_arch = OverArch(width, over_arch_layer_sizes)


expose(globals(), "pstrain.torch")
