"""_distribute: private; see "Layout" in docs/design.md."""
