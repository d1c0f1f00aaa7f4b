"""_base: private; see "Layout" in docs/design.md."""
