"""Aligned memory: numpy's own allocations (the compiled kernels align them for O_DIRECT)."""

from __future__ import annotations

__all__ = ["aligned_allocations"]


def aligned_allocations() -> None:
    """numpy's own allocator stays (the compiled module's puts rows on cache lines; the
    reference needs no build)."""
    return None
