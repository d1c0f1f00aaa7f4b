"""_serving: private; see "Layout" in docs/architecture.md."""
