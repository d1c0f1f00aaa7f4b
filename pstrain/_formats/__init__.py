"""_formats: private; see "Layout" in docs/design.md."""
