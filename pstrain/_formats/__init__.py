"""_formats: private; see README "Layout"."""
