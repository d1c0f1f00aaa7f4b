"""_training: private; see "Layout" in docs/architecture.md."""
