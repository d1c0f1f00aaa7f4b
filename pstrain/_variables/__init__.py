"""_variables: private; see "Layout" in docs/architecture.md."""
