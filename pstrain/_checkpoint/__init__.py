"""_checkpoint: private; see "Layout" in docs/design.md."""
