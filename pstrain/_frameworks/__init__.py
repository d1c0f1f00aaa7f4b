"""_frameworks: private; see "Layout" in docs/architecture.md."""
