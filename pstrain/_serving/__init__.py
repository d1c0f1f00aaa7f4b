"""_serving: private; see README "Layout"."""
