"""_frameworks: private; see README "Layout"."""
