"""A ps held to a ``--memory-budget`` has every thread allocate from one heap
(:func:`pstrain.cli.memory.one_heap`): what its reading and saving threads free is not kept
in heaps of their own, past the budget."""

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
    assert said == "every thread allocates from one heap (a ps held to --memory-budget)"
    count, said = heaps("many")
    assert count > 1 and said == "None", count
