"""_base: private; see README "Layout"."""
