"""PyTorch modules whose parameters live on the ps, pooled embeddings (``EmbeddingBag``,
``EmbeddingBagCollection``) and unpooled ones (``EmbeddingCollection``, for sequence
features): TorchRec's configs map one to one; TorchRec's DLRM and MLP over them."""

from ._frameworks.torch import *  # noqa: F403
from ._frameworks.torch import __all__ as _modules
from ._frameworks.torch_bags import *  # noqa: F403
from ._frameworks.torch_bags import __all__ as _bags
from ._frameworks.torch_dlrm import *  # noqa: F403
from ._frameworks.torch_dlrm import __all__ as _dlrm
from ._frameworks.torch_sequences import *  # noqa: F403
from ._frameworks.torch_sequences import __all__ as _sequences
from ._frameworks.torchrec_configs import *  # noqa: F403
from ._frameworks.torchrec_configs import __all__ as _configs

__all__ = [*_modules, *_bags, *_sequences, *_dlrm, *_configs]
