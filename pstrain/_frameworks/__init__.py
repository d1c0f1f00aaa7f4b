"""_frameworks: private; see "Layout" in docs/design.md."""
