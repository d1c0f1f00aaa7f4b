"""_transport: private; see README "Layout"."""
