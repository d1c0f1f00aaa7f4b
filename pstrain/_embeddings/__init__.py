"""Embedding tables as ranking models use them: jagged features, pooled lookups, collections of tables."""
