"""_transport: private; see "Layout" in docs/design.md."""
