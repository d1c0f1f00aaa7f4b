"""_base: private; see "Layout" in docs/architecture.md."""
