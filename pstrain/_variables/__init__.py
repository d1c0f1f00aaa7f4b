"""_variables: private; see README "Layout"."""
