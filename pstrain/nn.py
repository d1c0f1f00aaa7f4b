"""``pstrain.nn``: TF's embedding lookups (``tf.nn.embedding_lookup``,
``tf.nn.embedding_lookup_sparse``, ``tf.nn.safe_embedding_lookup_sparse``) on pstrain's
tables; the same functions as ``pstrain.embedding_lookup*``."""

from ._embeddings.pooling import embedding_lookup_sparse, safe_embedding_lookup_sparse
from ._variables.sharding import embedding_lookup

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "safe_embedding_lookup_sparse"]
