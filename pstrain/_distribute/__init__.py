"""_distribute: private; see "Layout" in docs/architecture.md."""
