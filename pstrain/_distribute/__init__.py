"""_distribute: private; see README "Layout"."""
