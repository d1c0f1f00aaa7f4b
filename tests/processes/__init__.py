"""processes tier (see tests/README.md)."""
