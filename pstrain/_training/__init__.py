"""_training: private; see README "Layout"."""
