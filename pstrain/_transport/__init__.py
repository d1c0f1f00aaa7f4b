"""_transport: private; see "Layout" in docs/architecture.md."""
