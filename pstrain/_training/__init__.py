"""_training: private; see "Layout" in docs/design.md."""
