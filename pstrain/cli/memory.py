"""How much freed memory a worker keeps for its next steps' arrays.

A training step allocates its batch, its pooled rows, its activations and its gradients
afresh, megabytes each, and frees them when it ends. glibc's malloc gives memory that large
back to the kernel (an array over its mmap threshold is unmapped when freed; a thread's heap
is trimmed once its free top passes the trim threshold), so the next step faults every page
in again, each one zeroed by the kernel: thousands of page faults a step, paid in kernel
time on the core the step runs on. ``pstrain serve --role worker`` has malloc keep up to
``--keep-freed`` bytes of freed memory (256 MiB unless told) and serve every array under
32 MiB from it, as TensorFlow's own allocator keeps its memory (and as the jemalloc or
tcmalloc that PyTorch's CPU tuning guide has users preload do). The price is that the
worker's resident memory stays at its largest step's, up to that many bytes more. Other
roles keep glibc's behaviour: a ps allocates little per step.

A ps held to a ``--memory-budget`` goes the other way (:func:`one_heap`): every thread
allocates from malloc's one main heap, and malloc keeps at most 16 MiB of what is freed, a
sixteenth of the budget if that is less (and maps arrays from 4 MiB, or a 32nd of it, on
their own): under 32 MiB, requests of 16,384 ids left a ps 1.26x its budget when malloc
kept 16 MiB of what they freed, 1.08x now. glibc otherwise gives each thread that
allocates at the same time as another a heap of its own (up to eight per core) and keeps
what is freed in each for that thread's next arrays: a tiered ps reads rows from disk and
writes saves on threads, and on W9 (40 MiB budgets, segments small enough to be compacted)
their heaps held the ps at 1.35-1.42x its budget at the peak, against 1.13x with one heap;
with W9's usual segments, 1.15x against 1.08x.

Both are glibc's: elsewhere (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import cast

from .._base.checks import byte_size
from .._base.errors import InvalidArgumentError

__all__ = ["DEFAULT_KEEP", "KEEP_MAX", "bounded_thresholds", "keep_freed", "keep_freed_size", "one_heap"]

#: ``mallopt``'s parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc's largest mmap threshold on 64-bit (half a thread heap): larger arrays are still
#: mapped and unmapped one by one.
MMAP_THRESHOLD_MAX = 32 << 20
#: A ps held to a budget: arrays from 4 MiB are mapped and unmapped one by one, and at
#: most 16 MiB of freed memory is kept. glibc's own thresholds move up as large arrays are
#: freed (to 32 MiB mapped, 64 MiB kept), and the heap then keeps what it cannot give back
#: below arrays still in use: on W9 as written (512 MiB budgets) a ps peaked at 1.20x its
#: budget; 1.12-1.14x with these (three rounds), 1.15-1.17x mapping from 8 MiB.
BOUNDED_MMAP = 4 << 20
BOUNDED_TRIM = 16 << 20
#: glibc's own mmap threshold, the least either is set to under a small budget.
MIN_THRESHOLD = 128 << 10
#: What a worker keeps unless ``--keep-freed`` says otherwise.
DEFAULT_KEEP = 256 << 20
#: The most ``mallopt`` takes (an ``int``).
KEEP_MAX = (1 << 31) - 1


def keep_freed_size(text: str) -> int:
    """``--keep-freed``'s value: a size (``256MiB``), or 0 for glibc's own behaviour.

    >>> keep_freed_size("64MiB"), keep_freed_size("0")
    (67108864, 0)
    >>> keep_freed_size("3GiB")
    Traceback (most recent call last):
    pstrain.errors.InvalidArgumentError: --keep-freed must be at most 2GiB, got 3221225472
    """
    if text.strip() == "0":
        return 0
    size = byte_size(text, "--keep-freed")
    if size > KEEP_MAX:
        raise InvalidArgumentError(f"--keep-freed must be at most 2GiB, got {size}")  # (an int to malloc)
    return size


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None (another libc: those read its parameters otherwise)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc's alone: other mallocs read mallopt otherwise
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return cast("Callable[[int, int], int]", mallopt)


def keep_freed(keep: int) -> str | None:
    """Have this process's malloc keep up to ``keep`` bytes of freed memory and serve
    arrays under 32 MiB from it; returns what it set, to log, or None: nothing changed
    (``keep`` 0, or not glibc)."""
    if keep <= 0:
        return None
    mallopt = _mallopt()
    if mallopt is None:
        return None
    keep = min(keep, KEEP_MAX)
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, keep)):
        return None
    return f"malloc keeps up to {keep >> 20} MiB of freed memory for the next steps' arrays (--keep-freed)"


def bounded_thresholds(budget: int | None) -> tuple[int, int]:
    """(mmap threshold, trim threshold) for a ps held to ``budget`` bytes: ``BOUNDED_MMAP``
    and ``BOUNDED_TRIM``, or a 32nd and a 16th of a budget too small for them (at least
    glibc's own 128 KiB): what malloc keeps of a request's freed arrays is then a small
    share of the RSS the budget allows, however small the budget.

    >>> bounded_thresholds(512 << 20) == (BOUNDED_MMAP, BOUNDED_TRIM)
    True
    >>> [t >> 20 for t in bounded_thresholds(32 << 20)]
    [1, 2]
    """
    if budget is None:
        return BOUNDED_MMAP, BOUNDED_TRIM
    return (
        max(MIN_THRESHOLD, min(BOUNDED_MMAP, budget // 32)),
        max(MIN_THRESHOLD, min(BOUNDED_TRIM, budget // 16)),
    )


def one_heap(budget: int | None = None) -> str | None:
    """Have every thread of this process allocate from malloc's main heap (a ps held to a
    ``--memory-budget`` of ``budget`` bytes: what one thread frees is not kept for it
    alone), map every array past a threshold on its own and keep little freed memory
    (:func:`bounded_thresholds`); called before the process starts its threads. Returns
    what it set, to log, or None: not glibc."""
    mallopt = _mallopt()
    if mallopt is None or not mallopt(_M_ARENA_MAX, 1):
        return None
    mmap, trim = bounded_thresholds(budget)
    if not (mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, trim)):
        return None
    return (
        "every thread allocates from one heap, and malloc keeps at most "
        f"{trim / (1 << 20):g} MiB of freed memory (a ps held to --memory-budget)"
    )
