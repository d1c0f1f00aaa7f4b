# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The kernels in C (built by ``pip install``), one module made of a file a concept: the id
indexes (``id_index.pxi``), the sparse optimizer steps (``optimizer_rows.pxi``), pooled bags
and a dataset's batches (``bags.pxi``), a table's rows and their bookkeeping (``rows.pxi``),
a batch's distinct ids (``distinct_ids.pxi``), a dynamic table's new rows (``new_rows.pxi``),
rows on cache lines (``aligned_memory.pxi``), reads of records from disk (``io_uring.pxi``),
string hashes (``strings.pxi``) and TFRecord files and tf.Example protos (``tf_records.pxi``).
Each loop runs without the GIL and without Python per id; :mod:`pstrain._kernels.reference`
is the numpy implementation they are tested against, bit for bit, a module for each of these
files under its name (``reference/id_index.py`` ...). See :mod:`pstrain._kernels`.

One module rather than one a concept: the kernels are chosen as a whole (compiled, or the
numpy reference with ``PSTRAIN_KERNELS=numpy``), and the parts share the helpers below."""

cimport cython
import numpy as np

from libc.math cimport sqrt, sqrtf
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

cdef extern from *:
    void __builtin_prefetch(const void*) nogil
    int __builtin_ctzll(unsigned long long) nogil
    int __builtin_clzll(unsigned long long) nogil

cdef extern from *:
    """
    #define _prefetchw(p) __builtin_prefetch((p), 1, 3)
    """
    void _prefetchw(const void*) nogil  # for writing

#: Rows ahead whose memory a loop over scattered rows asks for before it needs it (the
#: rows of a batch are far apart: without it each row waits for its cache misses in turn).
DEF AHEAD = 8
#: Ids ahead whose index slot a probe loop asks for (a slot is one cache line: more fit).
DEF PROBE_AHEAD = 32

ctypedef fused real:
    float
    double

ctypedef fused index_t:
    int32_t
    int64_t


cdef inline void _prefetch(const char* row, Py_ssize_t nbytes) noexcept nogil:
    """Ask for the first cache lines of a row (up to 256 bytes) before they are read."""
    cdef Py_ssize_t k = 0
    while k < nbytes and k < 256:
        __builtin_prefetch(row + k)
        k += 64


cdef inline void _prefetch_write(char* row, Py_ssize_t nbytes) noexcept nogil:
    """:func:`_prefetch` of a row about to be written."""
    cdef Py_ssize_t k = 0
    while k < nbytes and k < 256:
        _prefetchw(row + k)
        k += 64


cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    # splitmix64's finalizer, as pstrain._formats.idhash.mix64
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef inline bint _ascending(const int64_t* v, Py_ssize_t n) noexcept nogil:
    """Whether ``v[:n]`` is strictly ascending (a sorted batch's: distinct by its order)."""
    cdef Py_ssize_t i
    for i in range(1, n):
        if v[i] <= v[i - 1]:
            return False
    return True


# The parts, in the order they build on each other.
include "id_index.pxi"
include "optimizer_rows.pxi"
include "bags.pxi"
include "rows.pxi"
include "distinct_ids.pxi"
include "new_rows.pxi"
include "aligned_memory.pxi"
include "io_uring.pxi"
include "strings.pxi"
include "tf_records.pxi"
