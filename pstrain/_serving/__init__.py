"""_serving: private; see "Layout" in docs/design.md."""
