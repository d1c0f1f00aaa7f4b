"""``pstrain.nn``: TF's embedding lookups (``tf.nn.embedding_lookup``,
``tf.nn.embedding_lookup_sparse``, ``tf.nn.safe_embedding_lookup_sparse``) on pstrain's
tables; the same functions as ``pstrain.embedding_lookup*``. A lookup of bags of ids gives
:class:`RaggedRows`, as TF's gives a RaggedTensor."""

from ._embeddings.pooling import embedding_lookup_sparse, safe_embedding_lookup_sparse
from ._embeddings.ragged_rows import RaggedRows, embedding_lookup

__all__ = ["RaggedRows", "embedding_lookup", "embedding_lookup_sparse", "safe_embedding_lookup_sparse"]
