"""cluster tier (see tests/README.md)."""
