"""_variables: private; see "Layout" in docs/design.md."""
