"""system tier (see tests/README.md)."""
