"""Aligned memory: numpy's own allocator (the compiled kernels start new arrays on a
64-byte boundary)."""

from __future__ import annotations

__all__ = ["aligned_allocations"]


def aligned_allocations() -> None:
    """numpy's own allocator stays (the compiled module's puts rows on cache lines; the
    reference needs no build)."""
    return None
