"""_coordinator: private; see "Layout" in docs/architecture.md."""
