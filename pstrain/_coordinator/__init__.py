"""_coordinator: private; see "Layout" in docs/design.md."""
