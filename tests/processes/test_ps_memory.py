"""A ps held to a ``--memory-budget`` has every thread allocate from one heap
(:func:`pstrain.cli.memory.one_heap`): what its reading and saving threads free is not kept
in heaps of their own, past the budget; and arrays of 4 MiB or more are mapped one by one,
given back when freed, not kept in holes of the heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

#: Threads allocating at once, then glibc's own account of its heaps (``malloc_stats``,
#: printed to stderr: one "Arena <n>:" block per heap).
THREADS = """
import ctypes, sys, threading
import numpy as np
from pstrain.cli.memory import one_heap
said = one_heap() if sys.argv[1] == "one" else None
start = threading.Barrier(4)
def work():
    start.wait()
    for _ in range(200):
        held = [np.ones(4096, np.uint8) for _ in range(50)]
        del held
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(said)
sys.stdout.flush()
ctypes.CDLL(None).malloc_stats()
"""


def heaps(mode: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", THREADS, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stderr.count("Arena "), done.stdout.strip()


def test_a_ps_held_to_a_budget_allocates_from_one_heap_and_others_from_many():
    count, said = heaps("one")
    assert count == 1, count
    assert said == (
        "every thread allocates from one heap, and malloc keeps at most 16 MiB of freed memory "
        "(a ps held to --memory-budget)"
    )
    count, said = heaps("many")
    assert count > 1 and said == "None", count


#: A large array freed (glibc then raises its mmap threshold to its size: arrays up to it
#: come from the heap), then 16 arrays of 12 MiB made, each with a small one after it that
#: stays, and freed: the heap cannot give back what lies below a block in use. Prints how
#: much more the process holds than before them (KiB).
FREED = """
import sys
import numpy as np
from pstrain.cli.memory import one_heap
if sys.argv[1] == "one":
    one_heap()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
big = np.ones(30 << 20, np.uint8)
del big
before = rss()
held, kept = [], []
for _ in range(16):
    held.append(np.ones(12 << 20, np.uint8))
    kept.append(np.ones(64 << 10, np.uint8))
del held
print(rss() - before)
"""


def kept_kib(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FREED, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.strip())


def test_a_ps_held_to_a_budget_gives_back_the_large_arrays_it_frees():
    assert kept_kib("one") <= 4 << 10  # the 12 MiB arrays mapped one by one, given back
    assert kept_kib("many") > 96 << 10  # glibc's own: most of the 192 MiB freed kept
