"""_checkpoint: private; see README "Layout"."""
