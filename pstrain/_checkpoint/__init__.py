"""_checkpoint: private; see "Layout" in docs/architecture.md."""
