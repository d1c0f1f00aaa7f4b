"""_coordinator: private; see README "Layout"."""
