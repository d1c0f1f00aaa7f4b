# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The table kernels in C (built by ``pip install``): the id index's probe, insert and delete,
the fused sparse optimizer steps, a lookup's and an update's bookkeeping, a new row's
creation, an eviction's victims, and a batch's distinct ids (sorted by a radix sort) and
per-id sums. Each loop runs without the GIL and without Python per id;
:mod:`pstrain._kernels.reference` is the numpy implementation they are tested against, bit
for bit. See :mod:`pstrain._kernels`."""

cimport cython
import numpy as np

from libc.math cimport sqrt, sqrtf
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.errno cimport EAGAIN, EBUSY, errno
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy
from posix.unistd cimport pread

cdef extern from *:
    void __builtin_prefetch(const void*) nogil
    int __builtin_ctzll(unsigned long long) nogil

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
#: Ids ahead whose row a pooled lookup (or its backward) asks for: a row is a cache line or
#: two of a batch's distinct rows, read in the order the bags name them.
DEF POOL_AHEAD = 16
#: Bags (or examples) ahead whose memory a dataset's batch asks for: a bag is a few ids,
#: two cache misses (its offsets, then its values) that more bags in flight hide.
DEF BAG_AHEAD = 24
#: A read of records from disk reads past dead records between live ones up to this many
#: bytes apart, in spans of at most ``READ_SPAN`` bytes (see :func:`pread_records`).
DEF READ_GAP = 16384
DEF READ_SPAN = 1 << 20
#: Buckets of the key histograms that narrow down an eviction's victims.
DEF BUCKETS = 65536

ctypedef fused real:
    float
    double

ctypedef fused index_t:
    int32_t
    int64_t

# An id index's slot is (id, value), side by side, one probe one cache line: a value of
# EMPTY marks a slot without an id (a deletion leaves no tombstone).
DEF EMPTY = -1


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


cdef extern from *:
    """
    /* An id's first slot in an index of ``size`` slots: the high half of its hash times
       the size (any size, not only a power of two: an index grows by less than twice). */
    static inline uint64_t pstrain_home(uint64_t hash, uint64_t size) {
        return (uint64_t)(((unsigned __int128)hash * size) >> 64);
    }
    """
    uint64_t pstrain_home(uint64_t hash, uint64_t size) nogil


cdef inline uint64_t _home(int64_t key, uint64_t size) noexcept nogil:
    return pstrain_home(_mix64(<uint64_t>key), size)


cdef inline uint64_t _next(uint64_t q, uint64_t size) noexcept nogil:
    """The slot after ``q``, round."""
    q += 1
    return q if q < size else 0


cdef inline uint64_t _behind(uint64_t a, uint64_t b, uint64_t size) noexcept nogil:
    """How many slots ``b`` lies past ``a``, round."""
    return b - a if b >= a else b + size - a


cdef inline Py_ssize_t _slot(const int64_t* slots, uint64_t size, int64_t key) noexcept nogil:
    """The slot holding ``key``, -1 where none does: linear probing from its hash, past other
    ids, to an empty slot."""
    cdef uint64_t q = _home(key, size)
    cdef int64_t v
    while True:
        v = slots[2 * q + 1]
        if v == EMPTY:
            return -1
        if slots[2 * q] == key:
            return <Py_ssize_t>q
        q = _next(q, size)


cdef inline void _check_slots(Py_ssize_t rows, Py_ssize_t width, uint64_t size) except *:
    if width != 2 or <uint64_t>rows != size or size == 0:
        raise ValueError(f"an id index's slots are (size, 2) = ({size}, 2), got ({rows}, {width})")


cdef inline void _prefetch_slot(const int64_t* slots, uint64_t size, int64_t key) noexcept nogil:
    """Ask for the memory of ``key``'s first slot ahead of the probe."""
    __builtin_prefetch(slots + 2 * _home(key, size))


cdef inline bint _ascending(const int64_t* v, Py_ssize_t n) noexcept nogil:
    """Whether ``v[:n]`` is strictly ascending (a sorted batch's: distinct by its order)."""
    cdef Py_ssize_t i
    for i in range(1, n):
        if v[i] <= v[i - 1]:
            return False
    return True


cdef inline Py_ssize_t _probe(const int64_t* s, uint64_t size, const int64_t* ids, Py_ssize_t i,
                              Py_ssize_t n) noexcept nogil:
    """The slot holding ``ids[i]`` (-1 where none), the first slot of ``ids[i + PROBE_AHEAD]``
    asked for ahead."""
    if i + PROBE_AHEAD < n:
        _prefetch_slot(s, size, ids[i + PROBE_AHEAD])
    return _slot(s, size, ids[i])


cdef inline void _insert_at(int64_t* s, uint64_t size, int64_t key, int64_t value) noexcept nogil:
    """Put ``key`` (absent) with ``value`` (at least 0) in the first empty slot of its probe."""
    cdef uint64_t q = _home(key, size)
    while s[2 * q + 1] >= 0:
        q = _next(q, size)
    s[2 * q] = key
    s[2 * q + 1] = value


@cython.final
cdef class _IdSet:
    """A batch's hash set of ids, twice the size of what it will hold, probed linearly, each
    slot's id beside its value (one cache line read per probe): ``add`` gives the value an
    id was added with, or -1 after adding it."""
    cdef object _slots
    cdef int64_t* s
    cdef uint64_t size

    def __cinit__(self, Py_ssize_t n):
        cdef Py_ssize_t cap = 16
        while cap < 2 * n:
            cap <<= 1
        self._slots = np.full((cap, 2), -1, np.int64)
        cdef int64_t[:, ::1] slots = self._slots
        self.s, self.size = &slots[0, 0], <uint64_t>cap

    cdef inline void prefetch(self, int64_t k) noexcept nogil:
        """Ask for the memory of ``k``'s first slot ahead of its ``add``."""
        _prefetch_slot(self.s, self.size, k)

    cdef inline int64_t add(self, int64_t k, int64_t value) noexcept nogil:
        cdef uint64_t q = _home(k, self.size)
        while self.s[2 * q + 1] >= 0:
            if self.s[2 * q] == k:
                return self.s[2 * q + 1]
            q = _next(q, self.size)
        self.s[2 * q] = k
        self.s[2 * q + 1] = value
        return -1


def index_get(const int64_t[:, ::1] slots, uint64_t size, const int64_t[::1] ids, int64_t[::1] out):
    """``out[i]``: the value of ``ids[i]``, -1 where the index has none."""
    cdef Py_ssize_t i, q, n = ids.shape[0]
    cdef const int64_t* s = &slots[0, 0]
    _check_slots(slots.shape[0], slots.shape[1], size)
    with nogil:
        for i in range(n):
            q = _probe(s, size, &ids[0], i, n)
            out[i] = s[2 * q + 1] if q >= 0 else -1


def index_refind(const int64_t[:, ::1] slots, uint64_t size, const int64_t[::1] ids,
                 int64_t[::1] pos):
    """``pos[i]`` of each ``ids[i]`` without a row there (``pos[i] < 0``): the value the index
    has for it now, -1 where none (the rows of ids admitted since ``pos`` was found). The
    slots of the next PROBE_AHEAD such ids are asked for ahead (``ahead`` of them past ``j``)."""
    cdef Py_ssize_t i, q, j = 0, ahead = 0, n = ids.shape[0]
    cdef const int64_t* s = &slots[0, 0]
    _check_slots(slots.shape[0], slots.shape[1], size)
    if pos.shape[0] != n:
        raise ValueError(f"index_refind: {pos.shape[0]} rows for {n} ids")
    with nogil:
        for i in range(n):
            if pos[i] >= 0:
                continue
            if i < j:
                ahead -= 1  # asked for already
            else:
                j = i + 1
            while j < n and ahead < PROBE_AHEAD:
                if pos[j] < 0:
                    _prefetch_slot(s, size, ids[j])
                    ahead += 1
                j += 1
            q = _slot(s, size, ids[i])
            pos[i] = s[2 * q + 1] if q >= 0 else -1


def absent(const int64_t[::1] ids, const int64_t[::1] pos):
    """The ids without a row (``pos[i] < 0``): ``(where, ids[where])``, in two passes over
    ``pos`` (numpy's takes a comparison, a nonzero and a take)."""
    cdef Py_ssize_t i, k = 0, n = pos.shape[0]
    if ids.shape[0] != n:
        raise ValueError(f"absent: {n} rows for {ids.shape[0]} ids")
    with nogil:
        for i in range(n):
            k += pos[i] < 0
    where_, which_ = np.empty(k, np.int64), np.empty(k, np.int64)
    cdef int64_t[::1] where = where_, which = which_
    k = 0
    with nogil:
        for i in range(n):
            if pos[i] < 0:
                where[k] = i
                which[k] = ids[i]
                k += 1
    return where_, which_


def same_ids(const int64_t[::1] a, const int64_t[::1] b):
    """Whether ``a`` and ``b`` hold the same ids in the same order (one ``memcmp``)."""
    return a.shape[0] == b.shape[0] and (
        a.shape[0] == 0 or memcmp(&a[0], &b[0], a.shape[0] * sizeof(int64_t)) == 0)


def index_locate(int64_t[:, ::1] slots, uint64_t size, const int64_t[::1] ids,
                 int64_t[::1] out, uint8_t[::1] mark):
    """:func:`index_get` into ``out``, and whether ``ids`` are distinct, in the same pass:
    the slots found must be, and the ids without one (a hash set of just those). Ids
    strictly ascending (a sorted batch's) are distinct: their probes are all it takes.
    Otherwise each slot found is marked where it lies, its line just read (its value v
    becomes -2 - v, which no probe takes for an empty slot), and a second id finding a
    marked slot is a repeat; a second pass over the same slots restores them, ``out`` holding
    each id's slot in between (a ps reads its indexes on its serving loop alone, so nothing
    else sees a mark). ``mark`` (a byte per row, all 0) is the reference
    implementation's way; this one leaves it as it is: a byte array of rows beside the
    index costs a cache miss per id, twice (marking, unmarking)."""
    cdef Py_ssize_t i, q, r, n = ids.shape[0], limit = mark.shape[0], missing = 0
    cdef int64_t* s = &slots[0, 0]
    cdef int64_t v
    cdef bint repeated = False, bad = False, ascending
    _check_slots(slots.shape[0], slots.shape[1], size)
    if out.shape[0] < n:
        raise ValueError(f"index_locate: out has {out.shape[0]} places for {n} ids")
    with nogil:
        ascending = n == 0 or _ascending(&ids[0], n)
        if ascending:
            for i in range(n):
                q = _probe(s, size, &ids[0], i, n)
                r = s[2 * q + 1] if q >= 0 else -1
                out[i] = r
                bad = bad or r >= limit
        else:
            for i in range(n):  # out[i]: the slot found, -1 for none
                q = _probe(s, size, &ids[0], i, n)
                out[i] = q
                if q < 0:
                    missing += 1
                elif s[2 * q + 1] >= 0:
                    s[2 * q + 1] = -2 - s[2 * q + 1]
                else:
                    repeated = True
            for i in range(n):  # every slot marked above restored; out[i]: its row
                q = out[i]
                if q < 0:
                    continue
                v = s[2 * q + 1]
                if v < 0:
                    v = -2 - v
                    s[2 * q + 1] = v
                out[i] = v
                bad = bad or v >= limit
    if bad:
        raise IndexError("index_locate: a row past the table's end")
    if ascending:
        return True
    if repeated or missing < 2:
        return not repeated
    cdef _IdSet seen = _IdSet(missing)
    with nogil:
        for i in range(n):
            if out[i] < 0 and seen.add(ids[i], 0) >= 0:
                repeated = True
                break
    return not repeated


def index_insert(int64_t[:, ::1] slots, uint64_t size, const int64_t[::1] ids,
                 const int64_t[::1] rows):
    """Insert ``ids`` (unique, absent; the caller keeps the table at most half full) with
    ``rows`` (each at least 0), each in the first empty slot of its probe."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef int64_t* s = &slots[0, 0]
    _check_slots(slots.shape[0], slots.shape[1], size)
    if rows.shape[0] != n:
        raise ValueError(f"index_insert: {n} ids but {rows.shape[0]} rows")
    for i in range(n):  # checked before anything is written
        if rows[i] < 0:
            raise ValueError(f"index_insert: row {rows[i]}: rows are at least 0")
    with nogil:
        for i in range(n):
            if i + PROBE_AHEAD < n:
                _prefetch_slot(s, size, ids[i + PROBE_AHEAD])
            _insert_at(s, size, ids[i], rows[i])


cdef inline void _remove_at(int64_t* s, uint64_t size, Py_ssize_t q) noexcept nogil:
    """Empty slot ``q``, leaving no tombstone: the ids after it in its probe run move back
    into the hole where their own probe would pass it."""
    cdef uint64_t j = <uint64_t>q, hole = <uint64_t>q
    while True:
        j = _next(j, size)
        if s[2 * j + 1] == EMPTY:
            break
        # the id at j may fill the hole unless its home lies in (hole, j]
        if _behind(_home(s[2 * j], size), j, size) >= _behind(hole, j, size):
            s[2 * hole] = s[2 * j]
            s[2 * hole + 1] = s[2 * j + 1]
            hole = j
    s[2 * hole + 1] = EMPTY


def index_delete(int64_t[:, ::1] slots, uint64_t size, const int64_t[::1] ids, int64_t[::1] out):
    """Remove ``ids`` (unique); ``out[i]`` is the value ``ids[i]`` had, -1 where none.
    Returns how many were removed. No tombstone is left (:func:`_remove_at`), so a table
    that evicts as much as it admits never fills up with tombstones, nor needs rebuilding."""
    cdef Py_ssize_t i, q, n = ids.shape[0], removed = 0
    cdef int64_t* s = &slots[0, 0]
    _check_slots(slots.shape[0], slots.shape[1], size)
    with nogil:
        for i in range(n):
            q = _probe(s, size, &ids[0], i, n)
            if q < 0:
                out[i] = -1
                continue
            out[i] = s[2 * q + 1]
            removed += 1
            _remove_at(s, size, q)
    return removed


# A compact index (the rows on disk's): ids and values in two arrays, a value 32 bits
# (12 bytes a slot, not 16), EMPTY32 marking a slot without an id. A probe reads the values
# first (16 slots a cache line), an id only where a slot holds one.
cdef uint32_t EMPTY32 = 0xFFFFFFFF


cdef inline void _check_compact(Py_ssize_t nkeys, Py_ssize_t nvals, uint64_t size) except *:
    if <uint64_t>nkeys != size or <uint64_t>nvals != size or size == 0:
        raise ValueError(f"a compact index's ids and values are {size} each, got {nkeys} and {nvals}")


cdef inline Py_ssize_t _compact_slot(const int64_t* k, const uint32_t* v, uint64_t size,
                                     int64_t key) noexcept nogil:
    cdef uint64_t q = _home(key, size)
    while v[q] != EMPTY32:
        if k[q] == key:
            return <Py_ssize_t>q
        q = _next(q, size)
    return -1


cdef inline void _compact_prefetch(const int64_t* k, const uint32_t* v, uint64_t size,
                                   int64_t key) noexcept nogil:
    cdef uint64_t q = _home(key, size)
    __builtin_prefetch(v + q)
    __builtin_prefetch(k + q)


def compact_get(const int64_t[::1] keys, const uint32_t[::1] vals, uint64_t size,
                const int64_t[::1] ids, int64_t[::1] out):
    """``out[i]``: the value of ``ids[i]`` in a compact index, -1 where it has none."""
    cdef Py_ssize_t i, q, n = ids.shape[0]
    _check_compact(keys.shape[0], vals.shape[0], size)
    if out.shape[0] < n:
        raise ValueError(f"compact_get: out has {out.shape[0]} places for {n} ids")
    cdef const int64_t* k = &keys[0]
    cdef const uint32_t* v = &vals[0]
    with nogil:
        for i in range(n):
            if i + PROBE_AHEAD < n:
                _compact_prefetch(k, v, size, ids[i + PROBE_AHEAD])
            q = _compact_slot(k, v, size, ids[i])
            out[i] = v[q] if q >= 0 else -1


def compact_insert(int64_t[::1] keys, uint32_t[::1] vals, uint64_t size, const int64_t[::1] ids,
                   const int64_t[::1] rows):
    """Insert ``ids`` (unique, absent; the caller keeps room) with ``rows`` (0 to 2**32 - 2)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef uint64_t q
    _check_compact(keys.shape[0], vals.shape[0], size)
    if rows.shape[0] != n:
        raise ValueError(f"compact_insert: {n} ids but {rows.shape[0]} rows")
    for i in range(n):  # checked before anything is written
        if rows[i] < 0 or rows[i] >= EMPTY32:
            raise ValueError(f"compact_insert: row {rows[i]}: rows are 0 to {EMPTY32 - 1}")
    cdef int64_t* k = &keys[0]
    cdef uint32_t* v = &vals[0]
    with nogil:
        for i in range(n):
            if i + PROBE_AHEAD < n:
                _compact_prefetch(k, v, size, ids[i + PROBE_AHEAD])
            q = _home(ids[i], size)
            while v[q] != EMPTY32:
                q = _next(q, size)
            k[q] = ids[i]
            v[q] = <uint32_t>rows[i]


def compact_delete(int64_t[::1] keys, uint32_t[::1] vals, uint64_t size, const int64_t[::1] ids,
                   int64_t[::1] out):
    """Remove ``ids`` (unique); ``out[i]`` is the value ``ids[i]`` had, -1 where none. Returns
    how many were removed; no tombstone is left (as :func:`_remove_at`)."""
    cdef Py_ssize_t i, q, n = ids.shape[0], removed = 0
    cdef uint64_t j, hole
    _check_compact(keys.shape[0], vals.shape[0], size)
    if out.shape[0] < n:
        raise ValueError(f"compact_delete: out has {out.shape[0]} places for {n} ids")
    cdef int64_t* k = &keys[0]
    cdef uint32_t* v = &vals[0]
    with nogil:
        for i in range(n):
            q = _compact_slot(k, v, size, ids[i])
            if q < 0:
                out[i] = -1
                continue
            out[i] = v[q]
            removed += 1
            hole = j = <uint64_t>q
            while True:
                j = _next(j, size)
                if v[j] == EMPTY32:
                    break
                if _behind(_home(k[j], size), j, size) >= _behind(hole, j, size):
                    k[hole] = k[j]
                    v[hole] = v[j]
                    hole = j
            v[hole] = EMPTY32
    return removed


def count_sightings(int64_t[:, ::1] slots, uint64_t size, int64_t[::1] counts,
                    int64_t[::1] owners, const int64_t[::1] ids, const int64_t[::1] where,
                    int64_t[::1] admitted, int64_t threshold, Py_ssize_t next_slot,
                    Py_ssize_t room):
    """One sighting of each of ``ids`` (unique) in a sightings index (id -> slot of
    ``counts``, whose id ``owners`` holds), in one probe per id. An id whose count reaches
    ``threshold`` is admitted: ``where[i]`` (its place in the lookup) goes to the next of
    ``admitted``, it leaves the index and its count becomes 0. Another id in the index
    counts one more; one not in it is remembered at the next slot from ``next_slot`` with a
    count of 1, at most ``room`` of them: the loop stops before an id that would be one
    more (the caller keeps the index at most half full with ``room`` more, and ``counts``
    and ``owners`` that long). Returns (ids done, ids remembered, ids removed, ids
    admitted)."""
    cdef Py_ssize_t i, q, n = ids.shape[0], added = 0, removed = 0, done = ids.shape[0], k = 0
    cdef Py_ssize_t limit = counts.shape[0]
    cdef int64_t c, key
    cdef int64_t* s = &slots[0, 0]
    _check_slots(slots.shape[0], slots.shape[1], size)
    if where.shape[0] < n or admitted.shape[0] < n or owners.shape[0] < limit or next_slot < 0 \
            or room < 0 or next_slot + min(room, n) > limit:
        raise ValueError("count_sightings: where or admitted shorter than the ids, or no room in "
                         f"counts (next slot {next_slot} + room {room} of {limit})")
    with nogil:
        for i in range(n):
            key = ids[i]
            q = _probe(s, size, &ids[0], i, n)
            if q >= 0:
                c = counts[s[2 * q + 1]] + 1
                if c >= threshold:
                    admitted[k] = where[i]
                    k += 1
                    counts[s[2 * q + 1]] = 0
                    _remove_at(s, size, q)
                    removed += 1
                else:
                    counts[s[2 * q + 1]] = c
            elif threshold <= 1:
                admitted[k] = where[i]
                k += 1
            elif added == room:
                done = i
                break
            else:
                _insert_at(s, size, key, next_slot + added)
                counts[next_slot + added] = 1
                owners[next_slot + added] = key
                added += 1
    return done, added, removed, k


def sgd_rows(real[:, ::1] var, const int64_t[::1] rows, const real[:, ::1] g, real lr):
    """``var[rows[i]] -= lr * g[i]`` for each ``rows[i] >= 0`` (unique), in one pass."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef bint bad = False
    with nogil:
        for i in range(n):
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            for j in range(dim):
                var[r, j] = var[r, j] - lr * g[i, j]
    if bad:
        raise IndexError("sgd_rows: a row past the variable's end")


def adagrad_rows(real[:, ::1] var, real[:, ::1] acc, const int64_t[::1] rows,
                 const real[:, ::1] g, real lr, real eps):
    """Adagrad on the rows ``rows[i] >= 0`` (unique): gather row and accumulator, update,
    write back, one pass; the arithmetic of the numpy rule, in the variable's dtype."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef real gj, a
    cdef bint bad = False
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    with nogil:
        for i in range(n):
            if i + AHEAD < n and 0 <= rows[i + AHEAD] < limit:
                _prefetch(<const char*>&var[rows[i + AHEAD], 0], row_bytes)
                _prefetch(<const char*>&acc[rows[i + AHEAD], 0], row_bytes)
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            for j in range(dim):
                gj = g[i, j]
                a = acc[r, j] + gj * gj
                acc[r, j] = a
                if real is float:
                    var[r, j] = var[r, j] - (lr * gj) / sqrtf(a + eps)
                else:
                    var[r, j] = var[r, j] - (lr * gj) / sqrt(a + eps)
    if bad:
        raise IndexError("adagrad_rows: a row past the variable's end")


def rowwise_adagrad_rows(real[:, ::1] var, real[:, ::1] acc, const int64_t[::1] rows,
                         const real[:, ::1] g, real lr, real eps):
    """Row-wise Adagrad (TorchRec's default) on the rows ``rows[i] >= 0`` (unique): one
    accumulator per row grows by the mean of the squared gradient over the row (``acc``:
    one column, or as wide as ``var`` with every column holding it);
    ``var -= lr / (sqrt(acc) + eps) * g``."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef Py_ssize_t width = acc.shape[1]
    cdef real s, a, step
    cdef bint bad = False
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    if acc.shape[0] < limit or (width != 1 and width != dim):
        raise ValueError("rowwise_adagrad_rows: acc is not one column, or var's width, per row")
    with nogil:
        for i in range(n):
            if i + AHEAD < n and 0 <= rows[i + AHEAD] < limit:
                _prefetch(<const char*>&var[rows[i + AHEAD], 0], row_bytes)
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            s = 0
            for j in range(dim):
                s = s + g[i, j] * g[i, j]
            s = s / <real>dim
            a = acc[r, 0] + s
            for j in range(width):
                acc[r, j] = a
            if real is float:
                step = lr / (sqrtf(a) + eps)
            else:
                step = lr / (sqrt(a) + eps)
            for j in range(dim):
                var[r, j] = var[r, j] - step * g[i, j]
    if bad:
        raise IndexError("rowwise_adagrad_rows: a row past the variable's end")


def pool_bags(real[:, ::1] out, const int64_t[::1] offsets, const real[:, ::1] src,
              const int64_t[::1] idx, const real[::1] scale, Py_ssize_t out_col=0,
              Py_ssize_t src_col=0, Py_ssize_t width=-1, bint scatter=False):
    """Bag ``b`` is ``offsets[b]:offsets[b+1]`` of ``idx`` (and ``scale``: empty for all 1).
    Pooling: ``out[b, cols] += scale[i] * src[idx[i], cols]``; ``scatter``, its backward:
    ``out[idx[i], cols] += scale[i] * src[b, cols]``; in order of ``i`` either way, the
    columns ``out_col`` and ``src_col`` on, ``width`` of them (-1: all of ``out``'s). A bag's
    pooled row stays in the cache while its ids add into it, and the rows ahead are asked for
    before they are needed: the ids of a batch point all over its distinct rows."""
    cdef Py_ssize_t b, i, j, r, bags = offsets.shape[0] - 1, n = idx.shape[0]
    cdef Py_ssize_t n_out = out.shape[0], n_src = src.shape[0]
    cdef Py_ssize_t n_bags = n_src if scatter else n_out, n_rows = n_out if scatter else n_src
    cdef bint ones = scale.shape[0] == 0, bad = False
    cdef real c = 1
    cdef real* o
    cdef const real* x
    if width < 0:
        width = out.shape[1]
    if (not ones and scale.shape[0] != n) or bags < 0 or out_col < 0 or src_col < 0 \
            or out_col + width > out.shape[1] or src_col + width > src.shape[1]:
        raise ValueError("pool_bags: no offsets, scale not one per id, or the columns are "
                         "outside out or src")
    with nogil:  # checked before anything is added: a bad bag or row changes nothing
        bad = bags > n_bags or offsets[0] != 0 or offsets[bags] > n
        if not bad:
            for b in range(bags):
                if offsets[b + 1] < offsets[b]:
                    bad = True
                    break
        if not bad:
            for i in range(offsets[bags]):
                if idx[i] < 0 or idx[i] >= n_rows:
                    bad = True
                    break
    if bad:
        raise IndexError("pool_bags: a bag or a row outside out or src")
    with nogil:
        for b in range(bags):
            if scatter:
                x = &src[b, src_col]
            else:
                o = &out[b, out_col]
            for i in range(offsets[b], offsets[b + 1]):
                if i + POOL_AHEAD < offsets[bags]:
                    r = idx[i + POOL_AHEAD]
                    if scatter:
                        _prefetchw(&out[r, out_col])
                    else:
                        __builtin_prefetch(&src[r, src_col])
                if scatter:
                    o = &out[idx[i], out_col]
                else:
                    x = &src[idx[i], src_col]
                if ones:
                    for j in range(width):
                        o[j] = o[j] + x[j]
                else:
                    c = scale[i]
                    for j in range(width):
                        o[j] = o[j] + c * x[j]


def bag_positions(const int64_t[::1] offsets, const int64_t[::1] rows, int64_t[::1] out_offsets):
    """Bags ``rows`` of a jagged batch (``offsets``: where each bag starts, then the end),
    taken in order: their offsets into ``out_offsets`` (one more than ``rows``), and the
    positions of their values, returned (a batch's bags from a dataset, in one pass)."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], bags = offsets.shape[0] - 1, total = 0, at = 0
    cdef bint bad = False
    if out_offsets.shape[0] != n + 1:
        raise ValueError("bag_positions: out_offsets is not one longer than rows")
    with nogil:
        out_offsets[0] = 0
        for i in range(n):
            r = rows[i]
            if r < 0 or r >= bags:
                bad = True
                break
            total += offsets[r + 1] - offsets[r]
            out_offsets[i + 1] = total
    if bad:
        raise IndexError("bag_positions: a bag outside the batch")
    pos = np.empty(total, np.int64)
    cdef int64_t[::1] p = pos
    with nogil:
        for i in range(n):
            r = rows[i]
            for j in range(offsets[r], offsets[r + 1]):
                p[at] = j
                at += 1
    return pos


cdef inline void _copy_items(uint8_t* dst, const uint8_t* src, Py_ssize_t n, Py_ssize_t itemsize) noexcept nogil:
    """Copy ``n`` items of ``itemsize`` bytes: ids of 4 and 8 bytes one by one (a bag holds a
    few: a call to memcpy costs more than the copy), anything else by memcpy."""
    cdef Py_ssize_t k
    if itemsize == 4:
        for k in range(n):
            (<uint32_t*>dst)[k] = (<const uint32_t*>src)[k]
    elif itemsize == 8:
        for k in range(n):
            (<uint64_t*>dst)[k] = (<const uint64_t*>src)[k]
    else:
        memcpy(dst, src, n * itemsize)


def take_bags(
    const uint8_t[::1] values,
    Py_ssize_t itemsize,
    const int64_t[::1] offsets,
    const int64_t[::1] rows,
    int64_t[::1] out_offsets,
):
    """:func:`bag_positions` and the gather of the values in one pass: the bytes of bags
    ``rows`` (``values``: the batch's values as bytes, ``itemsize`` bytes each), end to end,
    with their offsets into ``out_offsets``. Each bag is one copy, its memory asked for
    :data:`BAG_AHEAD` bags before (a dataset's batch takes bags scattered over all of it)."""
    cdef Py_ssize_t i, r, n = rows.shape[0], bags = offsets.shape[0] - 1, total = 0, k
    cdef bint bad = False, bad_offsets = False
    if out_offsets.shape[0] != n + 1:
        raise ValueError("take_bags: out_offsets is not one longer than rows")
    if itemsize <= 0 or values.shape[0] % itemsize:
        raise ValueError("take_bags: values are not a whole number of items")
    with nogil:
        out_offsets[0] = 0
        for i in range(n):
            if i + BAG_AHEAD < n and 0 <= rows[i + BAG_AHEAD] < bags:
                __builtin_prefetch(&offsets[rows[i + BAG_AHEAD]])
            r = rows[i]
            if r < 0 or r >= bags:
                bad = True
                break
            if offsets[r] < 0 or offsets[r + 1] < offsets[r] or offsets[r + 1] * itemsize > values.shape[0]:
                bad_offsets = True
                break
            total += offsets[r + 1] - offsets[r]
            out_offsets[i + 1] = total
    if bad:
        raise IndexError("take_bags: a bag outside the batch")
    if bad_offsets:
        raise IndexError("take_bags: a bag's offsets outside its values")
    out = np.empty(total * itemsize, np.uint8)
    cdef uint8_t[::1] o = out
    if total == 0:
        return out
    with nogil:
        for i in range(n):
            if i + BAG_AHEAD < n:
                k = offsets[rows[i + BAG_AHEAD]] * itemsize
                _prefetch(<const char*>&values[0] + k, (offsets[rows[i + BAG_AHEAD] + 1] - offsets[rows[i + BAG_AHEAD]]) * itemsize)
            r = rows[i]
            _copy_items(&o[out_offsets[i] * itemsize], &values[offsets[r] * itemsize], offsets[r + 1] - offsets[r], itemsize)
    return out


def shuffle_through(int64_t[::1] buf, const int64_t[::1] incoming, const double[::1] draws,
                    int64_t[::1] out):
    """A buffer shuffle's steady state: for each incoming row ``i``, ``out[i]`` is the row
    in slot ``int(draws[i] * len(buf))`` of the buffer, which then holds ``incoming[i]``
    (``draws`` in [0, 1)): TF's ``shuffle``, a random row out for each row in."""
    cdef Py_ssize_t i, k, n = incoming.shape[0], size = buf.shape[0]
    if draws.shape[0] != n or out.shape[0] != n:
        raise ValueError("shuffle_through: incoming, draws and out differ in length")
    if n and size == 0:
        raise ValueError("shuffle_through: an empty buffer")
    for i in range(n):
        if not 0.0 <= draws[i] < 1.0:
            raise ValueError("shuffle_through: a draw outside [0, 1)")
    with nogil:
        for i in range(n):
            k = <Py_ssize_t>(draws[i] * size)
            out[i] = buf[k]
            buf[k] = incoming[i]


def take_fixed(const uint8_t[:, ::1] src, const int64_t[::1] rows, uint8_t[:, :] out):
    """``out[i] = src[rows[i]]`` for rows of any bytes (a batch of a rectangular array, or of
    bags all one long), each row's memory asked for :data:`BAG_AHEAD` rows before. ``out``'s
    rows may lie apart (a field of records), its bytes in a row side by side."""
    cdef Py_ssize_t i, r, n = rows.shape[0], width = src.shape[1], limit = src.shape[0]
    if out.shape[0] != n or out.shape[1] != width:
        raise ValueError("take_fixed: out is not (len(rows), the rows' bytes)")
    if width > 1 and out.strides[1] != 1:
        raise ValueError("take_fixed: out's rows are not each one run of bytes")
    for i in range(n):
        if rows[i] < 0 or rows[i] >= limit:
            raise IndexError("take_fixed: a row outside the array")
    if width == 0:
        return
    with nogil:
        for i in range(n):
            if i + BAG_AHEAD < n:
                _prefetch(<const char*>&src[rows[i + BAG_AHEAD], 0], width)
            _copy_items(&out[i, 0], &src[rows[i], 0], 1, width)


cdef inline bint _past_end(const int64_t[::1] pos, Py_ssize_t limit) noexcept nogil:
    """Whether a row of ``pos`` (-1: none) lies past ``limit``: checked before a pass writes
    anything, so a bad row changes nothing."""
    cdef Py_ssize_t i
    for i in range(pos.shape[0]):
        if pos[i] >= limit:
            return True
    return False


def gather_rows(const real[:, ::1] table, const int64_t[::1] pos, real[:, ::1] out, double default,
                int64_t[::1] last_seen=None, int64_t[::1] freq=None, int64_t clock=0):
    """``out[i] = table[pos[i]]``, or ``default`` in every column where ``pos[i]`` is -1.
    A training lookup's bookkeeping in the same pass: each row ``pos[i] >= 0`` (unique) was
    seen at ``clock`` (into ``last_seen``, if given) once more (into ``freq``, if given); a
    table whose eviction reads only one of them passes only that one."""
    cdef Py_ssize_t i, j, r, n = pos.shape[0], dim = table.shape[1], limit = table.shape[0]
    cdef real fill = <real>default
    cdef bint bad = False, ages = last_seen is not None, counts = freq is not None
    if out.shape[0] != n or out.shape[1] != dim:
        raise ValueError("gather_rows: out is not (len(pos), dim)")
    if (ages and last_seen.shape[0] < limit) or (counts and freq.shape[0] < limit):
        raise ValueError("gather_rows: last_seen or freq shorter than the table")
    if (ages or counts) and _past_end(pos, limit):  # before any bookkeeping is written
        raise IndexError("gather_rows: a row past the table's end")
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    with nogil:
        for i in range(n):
            if i + AHEAD < n and 0 <= pos[i + AHEAD] < limit:
                r = pos[i + AHEAD]
                _prefetch(<const char*>&table[r, 0], row_bytes)
                if ages:
                    _prefetchw(&last_seen[r])
                if counts:
                    _prefetchw(&freq[r])
            r = pos[i]
            if r < 0:
                for j in range(dim):
                    out[i, j] = fill
                continue
            if r >= limit:
                bad = True
                break
            if row_bytes:
                memcpy(&out[i, 0], &table[r, 0], row_bytes)
            if ages:
                last_seen[r] = clock
            if counts:
                freq[r] += 1
    if bad:
        raise IndexError("gather_rows: a row past the table's end")


def put_rows(real[:, ::1] out, const int64_t[::1] rows, const real[:, ::1] values, bint add=False):
    """``out[rows[i]] = values[i]`` for each ``rows[i] >= 0``, in order (a later row wins: a
    delta checkpoint's rows put into a restored array); with ``add``, ``+=`` (per-id sums of
    a batch's rows, bit for bit ``np.add.at``'s)."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = out.shape[1], limit = out.shape[0]
    cdef bint bad = False
    if values.shape[0] != n or values.shape[1] != dim:
        raise ValueError("put_rows: values are not (len(rows), dim)")
    with nogil:
        for i in range(n):
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            if add:
                for j in range(dim):
                    out[r, j] = out[r, j] + values[i, j]
            else:
                for j in range(dim):
                    out[r, j] = values[i, j]
    if bad:
        raise IndexError("put_rows: a row past the array's end")


def ascending_rows(const index_t[::1] rows, int64_t n, int64_t[::1] out=None):
    """A request's row ids checked in one pass: returns ``(the position of the first outside
    [0, n) or -1, whether they ascend strictly)`` (sorted and distinct, as a client's
    merged gradient sends them), copying them into ``out`` as int64 if given."""
    cdef Py_ssize_t i, m = rows.shape[0], bad = -1
    cdef int64_t r, prev = -1
    cdef bint up = True, copy = out is not None
    if copy and out.shape[0] != m:
        raise ValueError("ascending_rows: out is not as long as rows")
    with nogil:
        for i in range(m):
            r = rows[i]
            if r < 0 or r >= n:
                bad = i
                break
            if r <= prev:
                up = False
            prev = r
            if copy:
                out[i] = r
    return bad, up


def stamp_rows(uint32_t[::1] epochs, const int64_t[::1] pos, uint32_t epoch):
    """An update's bookkeeping: each row ``pos[i] >= 0`` changed in ``epoch`` (what a delta
    checkpoint reads). Returns how many rows that is, in one pass (numpy's keeps the rows
    found in a temporary first), each row's epoch asked for ``PROBE_AHEAD`` rows before (an
    update's rows are scattered over the table: a cache miss each)."""
    cdef Py_ssize_t i, k = 0, n = pos.shape[0]
    if _past_end(pos, epochs.shape[0]):
        raise IndexError("stamp_rows: a row past the table's end")
    with nogil:
        for i in range(n):
            if i + PROBE_AHEAD < n and pos[i + PROBE_AHEAD] >= 0:
                _prefetchw(&epochs[pos[i + PROBE_AHEAD]])
            if pos[i] >= 0:
                epochs[pos[i]] = epoch
                k += 1
    return k


cdef inline uint64_t _shift(uint64_t span) noexcept nogil:
    """The bits a key's offset drops for ``span + 1`` keys to fit the histogram's buckets."""
    cdef uint64_t shift = 0
    while (span >> shift) >= BUCKETS:
        shift += 1
    return shift


def pick_victims(const int64_t[::1] key, const uint8_t[::1] live, const int64_t[::1] protect,
                 uint8_t[::1] mark, Py_ssize_t used, Py_ssize_t n, int64_t low=0, int64_t high=-1):
    """The rows an eviction of ``n`` takes: of the rows below ``used`` that are ``live`` and
    not in ``protect``, the ``n`` of smallest ``key`` (the last lookup for LRU, the count for
    LFU), ties at the boundary going to the lowest rows; ascending. ``mark`` is the table's
    byte per row, all 0 (and again after). Histograms of the keys narrow down the n-th
    smallest (a few passes over the rows, no sort). Keys known to lie in [``low``,
    ``high``] (LRU's: no later than the clock) spare the pass that finds their range; a
    key outside it, or ``high < low``, and that pass runs."""
    cdef Py_ssize_t r, i, count = 0, limit = min(used, min(key.shape[0], min(live.shape[0], mark.shape[0])))
    cdef int64_t lo = 0, hi = 0, k, threshold
    cdef Py_ssize_t need, ties, b, nb
    cdef uint64_t shift
    cdef bint bad = False, filled = False
    hist_arr = np.zeros(BUCKETS, np.int64)
    cdef int64_t[::1] hist = hist_arr
    with nogil:
        for i in range(protect.shape[0]):
            r = protect[i]
            if r < 0 or r >= limit:
                bad = True
                break
        if not bad:
            for i in range(protect.shape[0]):
                mark[protect[i]] = 1
            if high >= low:  # the first histogram over the bounds, counting the rows with it
                lo, hi, filled = low, high, True
                shift = _shift(<uint64_t>hi - <uint64_t>lo)
                for r in range(limit):
                    if live[r] and not mark[r]:
                        k = key[r]
                        if k < lo or k > hi:
                            filled = False
                            break
                        hist[(<uint64_t>k - <uint64_t>lo) >> shift] += 1
                        count += 1
            if not filled:
                count = 0
                for r in range(limit):
                    if live[r] and not mark[r]:
                        k = key[r]
                        if count == 0 or k < lo:
                            lo = k
                        if count == 0 or k > hi:
                            hi = k
                        count += 1
    if bad:
        raise IndexError("pick_victims: a protected row past the table's end")
    n = max(0, min(n, count))
    out = np.empty(n, np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        need = n
        if 0 < n < count:
            # Narrow [lo, hi] to the bucket holding the n-th smallest key, until a bucket is
            # one key wide; ``need`` is then how many rows of that key are taken.
            while True:
                shift = _shift(<uint64_t>hi - <uint64_t>lo)
                nb = <Py_ssize_t>((<uint64_t>hi - <uint64_t>lo) >> shift) + 1
                if not filled:
                    for b in range(nb):
                        hist[b] = 0
                    for r in range(limit):
                        if live[r] and not mark[r]:
                            k = key[r]
                            if lo <= k <= hi:
                                hist[(<uint64_t>k - <uint64_t>lo) >> shift] += 1
                filled = False
                for b in range(nb):
                    if hist[b] >= need:
                        break
                    need -= hist[b]
                lo = <int64_t>(<uint64_t>lo + (<uint64_t>b << shift))
                if shift == 0:
                    break
                if <uint64_t>hi - <uint64_t>lo > ((<uint64_t>1 << shift) - 1):
                    hi = <int64_t>(<uint64_t>lo + ((<uint64_t>1 << shift) - 1))
            threshold = lo  # the n-th smallest key; ``need`` rows of it are taken, lowest first
            i = 0
            ties = need
            for r in range(limit):
                if live[r] and not mark[r]:
                    k = key[r]
                    if k < threshold:
                        o[i] = r
                        i += 1
                    elif k == threshold and ties > 0:
                        o[i] = r
                        i += 1
                        ties -= 1
        elif n == count:
            i = 0
            for r in range(limit):
                if live[r] and not mark[r]:
                    o[i] = r
                    i += 1
        for i in range(protect.shape[0]):
            mark[protect[i]] = 0
    return out


def rows_after(const uint32_t[::1] epochs, int64_t since, const uint8_t[::1] live=None,
               until=None):
    """The rows whose epoch is after ``since`` (and, given ``until``, not after it; given
    ``live``, whose byte there is not 0), ascending: what a delta checkpoint writes, found
    in one pass over the epochs (numpy's compares then ``flatnonzero`` make two and a
    temporary the array's length)."""
    cdef Py_ssize_t i, n = epochs.shape[0], k = 0
    cdef int64_t last = INT64_MAX if until is None else <int64_t>until
    if live is not None and live.shape[0] < n:
        raise ValueError(f"rows_after: {live.shape[0]} live flags for {n} rows")
    out = np.empty(n + 1, np.int64)  # pages only as far as it is filled
    cdef int64_t[::1] o = out
    with nogil:  # without a branch: each row is written where the next one found goes
        if live is None:
            for i in range(n):
                o[k] = i
                k += (<int64_t>epochs[i] > since) & (<int64_t>epochs[i] <= last)
        else:
            for i in range(n):
                o[k] = i
                k += (<int64_t>epochs[i] > since) & (<int64_t>epochs[i] <= last) & (live[i] != 0)
    return out[:k].copy()


def keep_changed(const int64_t[::1] rows, const uint32_t[::1] epochs, int64_t since, int64_t mark,
                 int64_t taken, const real[:, ::1] array, int64_t[::1] kept_rows,
                 real[:, ::1] kept_values, Py_ssize_t start):
    """Of ``rows`` (strictly ascending), those in ``taken:len(array)`` whose epoch is in
    ``(since, mark]``: each one's number into ``kept_rows`` and its values into
    ``kept_values``, from ``start`` on, in one pass; returns how many. -1, nothing written:
    ``rows`` is not strictly ascending. A delta's snapshot keeping the old values of the rows
    an update is about to change (:class:`~pstrain.server.ps.snapshots.ChangedRows`)."""
    cdef Py_ssize_t i, n = rows.shape[0], k = start, dim = array.shape[1]
    cdef Py_ssize_t limit = min(array.shape[0], epochs.shape[0])
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    cdef int64_t r, e
    if array.shape[0] > epochs.shape[0]:
        raise ValueError(f"keep_changed: {epochs.shape[0]} epochs for {array.shape[0]} rows")
    if kept_values.shape[1] != dim:
        raise ValueError("keep_changed: kept_values is not (capacity, dim)")
    if start < 0 or kept_rows.shape[0] - start < n or kept_values.shape[0] - start < n:
        raise ValueError(f"keep_changed: no room for {n} rows from {start}")
    with nogil:
        if n and not _ascending(&rows[0], n):
            k = -1
        if k >= 0:
            for i in range(n):
                if i + PROBE_AHEAD < n and 0 <= rows[i + PROBE_AHEAD] < limit:
                    __builtin_prefetch(&epochs[rows[i + PROBE_AHEAD]])
                r = rows[i]
                if r < taken or r < 0 or r >= limit:
                    continue
                e = epochs[r]
                if e <= since or e > mark:
                    continue
                kept_rows[k] = r
                if row_bytes:
                    memcpy(&kept_values[k, 0], &array[r, 0], row_bytes)
                k += 1
    return -1 if k < 0 else k - start


def unique_first(const int64_t[::1] ids):
    """``(unique, inverse)``: the distinct ids in the order they first occur, and for each id
    its position in ``unique`` (a hash set of twice the batch's size, probed linearly)."""
    cdef Py_ssize_t n = ids.shape[0], i, m = 0
    cdef _IdSet seen = _IdSet(n)
    unique = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    cdef int64_t[::1] u = unique, inv = inverse
    cdef int64_t v
    with nogil:
        for i in range(n):
            if i + PROBE_AHEAD < n:
                seen.prefetch(ids[i + PROBE_AHEAD])
            v = seen.add(ids[i], m)
            if v < 0:
                u[m] = ids[i]
                v = m
                m += 1
            inv[i] = v
    return unique[:m].copy(), inverse


cdef inline int64_t _ones(uint64_t x) noexcept nogil:
    """The bits set in ``x``, by shifts and masks: a build for any x86-64 has no popcount
    instruction to call, and the library call it gets instead costs more than this."""
    x = x - ((x >> 1) & 0x5555555555555555ULL)
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL
    return <int64_t>((x * 0x0101010101010101ULL) >> 56)


def unique_in_span(const int64_t[::1] ids, int64_t low, int64_t span):
    """``(unique ascending, inverse)`` of ``ids``, all in ``[low, low + span)``: a bit per
    value of the span marks the ids, the marks read in order are the distinct ids, and an
    id's position among them is the marks before it (counted a 64-bit word at a time). No
    hash and no sort: for a table's row numbers, where a batch's ids are a fair share of
    its rows, the bits (a row of a 1,000,000-row table is one bit of 122 KiB) stay in the
    cache."""
    cdef Py_ssize_t n = ids.shape[0], i, w, words, k = 0
    cdef uint64_t v, word
    cdef int64_t total = 0
    if span < 1 or span > (<int64_t>1 << 40):
        raise ValueError("unique_in_span: span must be 1 to 2**40")
    words = <Py_ssize_t>((span + 63) >> 6)
    for i in range(n):
        if ids[i] < low or <uint64_t>ids[i] - <uint64_t>low >= <uint64_t>span:
            raise IndexError("unique_in_span: an id outside the span")
    bits = np.zeros(words, np.uint64)
    before = np.empty(words, np.int64)
    inverse = np.empty(n, np.int64)
    cdef uint64_t[::1] b = bits
    cdef int64_t[::1] pre = before, inv = inverse
    with nogil:
        for i in range(n):
            v = <uint64_t>ids[i] - <uint64_t>low
            b[v >> 6] |= (<uint64_t>1) << (v & 63)
        for w in range(words):
            pre[w] = total
            total += _ones(b[w])
    unique = np.empty(total, np.int64)
    cdef int64_t[::1] u = unique
    with nogil:
        for w in range(words):
            word = b[w]
            while word:
                u[k] = low + (<int64_t>w << 6) + __builtin_ctzll(word)
                k += 1
                word &= word - 1
        for i in range(n):
            v = <uint64_t>ids[i] - <uint64_t>low
            inv[i] = pre[v >> 6] + _ones(b[v >> 6] & (((<uint64_t>1) << (v & 63)) - 1))
    return unique, inverse


def argsort_stable(const int64_t[::1] values, bint unsigned=False):
    """The order that sorts ``values`` ascending, equal values in their order (numpy's
    ``argsort(kind="stable")``), as uint64 if ``unsigned``: a least-significant-digit radix
    sort, a byte a pass, every byte's counts taken in one pass first and the passes where
    all values share the byte skipped (a table's small row numbers take two or three).
    Measured in :func:`~pstrain._kernels.batches.distinct` on W4's and W6's batches (6,300
    of 13,312 ids distinct): about half numpy's time."""
    cdef Py_ssize_t n = values.shape[0], i, d, pos, start
    cdef int p
    cdef uint64_t flip = 0 if unsigned else (<uint64_t>1) << 63
    keys_a = np.empty(n, np.uint64)
    keys_b = np.empty(n, np.uint64)
    order_a = np.empty(n, np.int64)
    order_b = np.empty(n, np.int64)
    counts = np.zeros((8, 256), np.intp)
    cdef uint64_t[::1] ka = keys_a, kb = keys_b
    cdef int64_t[::1] oa = order_a, ob = order_b
    cdef Py_ssize_t[:, ::1] count = counts
    cdef uint64_t k
    cdef bint swapped = False
    if n == 0:
        return order_a
    with nogil:
        for i in range(n):
            k = <uint64_t>values[i] ^ flip
            ka[i] = k
            oa[i] = i
            for p in range(8):
                count[p, (k >> (8 * p)) & 255] += 1
        for p in range(8):
            if count[p, (ka[0] >> (8 * p)) & 255] == n:
                continue  # one byte value throughout: the order stays
            pos = 0
            for d in range(256):
                start = pos
                pos += count[p, d]
                count[p, d] = start
            for i in range(n):
                d = (ka[i] >> (8 * p)) & 255
                kb[count[p, d]] = ka[i]
                ob[count[p, d]] = oa[i]
                count[p, d] += 1
            ka, kb = kb, ka
            oa, ob = ob, oa
            swapped = not swapped
    return order_b if swapped else order_a


def shard_ids(const int64_t[::1] ids, int64_t num_shards, uint64_t salt):
    """Each id's shard: ``mix64(id ^ salt) % num_shards`` (the hash routing a dynamic
    table's ids to the ps, and a ps's slices)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    if num_shards < 1:
        raise ValueError("shard_ids: num_shards must be at least 1")
    out = np.empty(n, np.int64)
    cdef int64_t[::1] o = out
    cdef uint64_t m = <uint64_t>num_shards
    with nogil:
        for i in range(n):
            o[i] = <int64_t>(_mix64(<uint64_t>ids[i] ^ salt) % m)
    return out


cdef object _columns(Py_ssize_t dim, uint64_t seed, uint64_t salt):
    """Each column's key in the initial-row formula: ``mix64(seed + column * salt)``."""
    columns = np.empty(dim, np.uint64)
    cdef uint64_t[::1] col = columns
    cdef Py_ssize_t j
    for j in range(dim):
        col[j] = _mix64(seed + <uint64_t>j * salt)
    return columns


cdef inline double _unit(uint64_t x, uint64_t column) noexcept nogil:
    """The initial-row formula's uniform number in [0, 1) for an id's ``x`` and a column."""
    return <double>(_mix64(x ^ column) >> 11) * (1.0 / 9007199254740992.0)


def create_rows(const int64_t[::1] rows, const int64_t[::1] new_ids, real[:, ::1] values,
                tuple slots, tuple inits, int64_t[::1] ids, uint8_t[::1] live,
                int64_t[::1] last_seen, int64_t[::1] freq, uint32_t[::1] epochs, int64_t lookups,
                uint32_t epoch, uint64_t seed, uint64_t golden, uint64_t salt, double low,
                double high):
    """A dynamic table's new rows ``rows`` for ``new_ids``, in one pass: each row's initial
    values (the formula of :func:`pstrain._formats.idhash.initial_rows`), each optimizer
    slot (``slots``, shaped as ``values``) at its initial value (``inits``), and its
    bookkeeping (id, live, last lookup, a count of 0, change epoch). New rows are far
    apart, so the memory of the rows AHEAD is asked for, for writing, before it is written:
    numpy's seven scattered writes wait for each cache miss in turn. A row outside the
    arrays is refused before anything is written."""
    cdef Py_ssize_t i, j, k, r, a, n = rows.shape[0], dim = values.shape[1], ns = len(slots)
    cdef Py_ssize_t limit = min(values.shape[0], ids.shape[0], live.shape[0], last_seen.shape[0],
                                freq.shape[0], epochs.shape[0])
    cdef uint64_t x
    cdef double span = high - low
    cdef real[:, ::1] view
    if new_ids.shape[0] != n or len(inits) != ns:
        raise ValueError(f"create_rows: {n} rows for {new_ids.shape[0]} ids, {ns} slots for "
                         f"{len(inits)} initial values")
    for i in range(n):
        if not 0 <= rows[i] < limit:
            raise IndexError("create_rows: a row outside the table")
    if n == 0:
        return
    addresses, initial = np.empty(ns, np.uintp), np.asarray(inits, np.float64)
    cdef uintptr_t[::1] slot_rows = addresses  # each slot's first row (the arrays in ``slots``)
    cdef const double[::1] slot_init = initial
    for k in range(ns):
        view = slots[k]
        if view.shape[0] != values.shape[0] or view.shape[1] != dim:
            raise ValueError("create_rows: a slot not shaped as the rows")
        slot_rows[k] = <uintptr_t>&view[0, 0]
    cdef uint64_t[::1] col = _columns(dim, seed, salt)
    with nogil:
        for i in range(n):
            if i + AHEAD < n:
                a = rows[i + AHEAD]
                _prefetch_write(<char*>&values[a, 0], dim * sizeof(real))
                for k in range(ns):
                    _prefetch_write(<char*>(<real*>slot_rows[k] + a * dim), dim * sizeof(real))
                _prefetchw(&ids[a])
                _prefetchw(&live[a])
                _prefetchw(&last_seen[a])
                _prefetchw(&freq[a])
                _prefetchw(&epochs[a])
            r = rows[i]
            x = <uint64_t>new_ids[i] * golden
            for j in range(dim):
                values[r, j] = <real>(low + span * _unit(x, col[j]))
            for k in range(ns):
                for j in range(dim):
                    (<real*>slot_rows[k])[r * dim + j] = <real>slot_init[k]
            ids[r] = new_ids[i]
            live[r] = 1
            last_seen[r] = lookups
            freq[r] = 0
            epochs[r] = epoch


# -- memory: rows that start on a cache line ------------------------------------------------
# numpy's allocator gives large arrays memory 16 bytes past a page's start: a 128-byte row
# (32 float32) then spans three cache lines, not two, and every row a lookup, an update or
# a delta touches costs half as much memory traffic again (a gather of 1.25M such rows from
# a 1.6 GB table: 31 ms against 23 ms aligned; an Adagrad-like read and add of 8,000:
# 0.70 ms against 0.29). Through numpy's allocator hooks (NEP 49), arrays made where
# :func:`aligned_allocations` was called start on a 64-byte boundary.
cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>

    #define PSTRAIN_ALIGN 64
    /* Huge pages asked for, as numpy's own allocator does, at and above this size. */
    #define PSTRAIN_HUGE (1u << 22)

    /* Each block is taken ALIGN bytes larger; its data starts at the first multiple of
       ALIGN past the block's start (1 to ALIGN bytes in), and the byte before the data
       says how far in it is. */
    static void *pstrain_place(char *base, size_t size) {
        if (base == NULL) return NULL;
        size_t shift = PSTRAIN_ALIGN - ((uintptr_t)base % PSTRAIN_ALIGN);
        base[shift - 1] = (char)shift;
    #ifdef MADV_HUGEPAGE
        if (size >= PSTRAIN_HUGE) {
            uintptr_t start = ((uintptr_t)base + 4095u) & ~(uintptr_t)4095u;
            uintptr_t end = ((uintptr_t)base + size + PSTRAIN_ALIGN) & ~(uintptr_t)4095u;
            if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
        }
    #endif
        return base + shift;
    }
    static void *pstrain_malloc(void *ctx, size_t size) {
        (void)ctx;
        if (size > SIZE_MAX - PSTRAIN_ALIGN) return NULL;
        return pstrain_place((char *)malloc(size + PSTRAIN_ALIGN), size);
    }
    static void *pstrain_calloc(void *ctx, size_t nelem, size_t elsize) {
        (void)ctx;
        if (elsize && nelem > (SIZE_MAX - PSTRAIN_ALIGN) / elsize) return NULL;
        /* calloc: a large block comes from fresh pages, zero without being written */
        return pstrain_place((char *)calloc(nelem * elsize + PSTRAIN_ALIGN, 1), nelem * elsize);
    }
    static void pstrain_free(void *ctx, void *ptr, size_t size) {
        (void)ctx; (void)size;
        if (ptr == NULL) return;
        free((char *)ptr - ((unsigned char *)ptr)[-1]);
    }
    static void *pstrain_realloc(void *ctx, void *ptr, size_t size) {
        if (ptr == NULL) return pstrain_malloc(ctx, size);
        if (size > SIZE_MAX - PSTRAIN_ALIGN) return NULL;
        size_t was = ((unsigned char *)ptr)[-1];
        char *base = (char *)realloc((char *)ptr - was, size + PSTRAIN_ALIGN);
        if (base == NULL) return NULL;  /* the old block stays as it was, as realloc's does */
        size_t shift = PSTRAIN_ALIGN - ((uintptr_t)base % PSTRAIN_ALIGN);
        /* the data moved with the block, `was` bytes in: both ranges lie inside it */
        if (shift != was) memmove(base + shift, base + was, size);
        base[shift - 1] = (char)shift;
        return base + shift;  /* (huge pages: a block moved by mremap keeps its advice) */
    }

    static PyDataMem_Handler pstrain_aligned_handler = {
        "pstrain_aligned_64", 1,
        {NULL, pstrain_malloc, pstrain_calloc, pstrain_realloc, pstrain_free}
    };
    static PyObject *pstrain_handler_capsule(void) {
        return PyCapsule_New(&pstrain_aligned_handler, "mem_handler", NULL);
    }
    """
    object pstrain_handler_capsule()

_ALIGNED = pstrain_handler_capsule()


def aligned_allocations():
    """Arrays made from now on in the current context (and in tasks and ``to_thread`` calls
    that copy it) start on a 64-byte boundary; returns the allocator that was in use."""
    return cnp.PyDataMem_SetHandler(_ALIGNED)


# -- reads of records through io_uring --------------------------------------------------------
# A tiered table's rows come back from disk as hundreds of small reads a request. One
# ``pread`` at a time waits for each in turn, and on a virtual disk each read that misses
# the page cache costs 25 to 30 µs of CPU (65 µs wall) on its own; submitted together
# through io_uring they cost about 3 µs each (9 µs wall: the disk serves them in
# parallel); those in the page cache cost about 1 µs either way (measured here, a 2 GB
# file, 288-byte records). The ring is the kernel's own interface (no liburing):
# one per thread that reads (rings are not shared between threads), made at its first
# read and closed when the thread ends. Where the kernel has none (before Linux 5.6, a
# sandbox that forbids it, ``kernel.io_uring_disabled``) or ``PSTRAIN_IO_URING=0``, the
# reads are ``pread`` calls, as before.
cdef extern from *:
    """
    #include <errno.h>
    #include <pthread.h>
    #include <sys/mman.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    #if defined(__linux__) && __has_include(<linux/io_uring.h>) && defined(__NR_io_uring_setup)
    #include <linux/io_uring.h>
    #endif
    /* IORING_OP_READ came with Linux 5.6, as did this feature flag (headers and kernel) */
    #if defined(__linux__) && defined(__NR_io_uring_setup) && defined(IORING_FEAT_RW_CUR_POS)
    #define PST_URING 1
    #else
    #define PST_URING 0
    #endif

    /* Reads a ring keeps in flight at once (its submission queue's size). */
    #define PST_RING_ENTRIES 128
    /* Times a submission the kernel has no memory for (EAGAIN) is tried before the reads
       are left to pread. */
    #define PST_BUSY_TRIES 10000
    /* The most bytes one read asks for (a longer run of records is read in pieces). */
    #define PST_MAX_READ (1 << 26)

    #if PST_URING
    typedef struct {
        int fd;
        unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask, entries;
        struct io_uring_sqe *sqes;
        struct io_uring_cqe *cqes;
        void *sq_map, *cq_map;
        size_t sq_len, cq_len, sqes_len;
        unsigned generation;
    } pst_ring;

    static pthread_key_t pst_ring_key;
    static pthread_once_t pst_ring_once = PTHREAD_ONCE_INIT;
    static int pst_ring_key_ok = 0;
    /* 1: rings work here; -1: they do not (every read a pread from then on); 0: not known yet */
    static volatile int pst_uring_state = 0;

    static void pst_ring_close(void *p) {
        pst_ring *r = (pst_ring *)p;
        if (r == NULL) return;
        munmap(r->sqes, r->sqes_len);
        munmap(r->cq_map, r->cq_len);
        munmap(r->sq_map, r->sq_len);
        close(r->fd);
        free(r);
    }

    /* A forked child's generation: a ring made before the fork is its parent's too. */
    static volatile unsigned pst_ring_generation = 0;

    static void pst_ring_forked(void) { pst_ring_generation++; }

    static void pst_ring_key_make(void) {
        pst_ring_key_ok = pthread_key_create(&pst_ring_key, pst_ring_close) == 0
                          && pthread_atfork(NULL, NULL, pst_ring_forked) == 0;
    }

    /* This thread's ring, made at its first use; NULL where rings cannot be had. */
    static pst_ring *pst_ring_get(void) {
        struct io_uring_params p;
        pst_ring *r;
        if (pst_uring_state < 0) return NULL;
        pthread_once(&pst_ring_once, pst_ring_key_make);
        if (!pst_ring_key_ok) { pst_uring_state = -1; return NULL; }
        r = (pst_ring *)pthread_getspecific(pst_ring_key);
        if (r != NULL && r->generation == pst_ring_generation) return r;
        if (r != NULL) {  /* this process forked since: the child leaves its parent's ring */
            pthread_setspecific(pst_ring_key, NULL);
            pst_ring_close(r);
        }
        r = (pst_ring *)calloc(1, sizeof(pst_ring));
        if (r == NULL) return NULL;
        memset(&p, 0, sizeof p);
        r->fd = (int)syscall(__NR_io_uring_setup, PST_RING_ENTRIES, &p);
        if (r->fd < 0) {
            /* no rings here (ENOSYS, EPERM, ...); ENOMEM or EMFILE may pass: try again later */
            if (errno != ENOMEM && errno != EMFILE && errno != ENFILE) pst_uring_state = -1;
            free(r);
            return NULL;
        }
        if (!(p.features & IORING_FEAT_RW_CUR_POS)) {  /* a kernel before 5.6: no IORING_OP_READ */
            close(r->fd);
            free(r);
            pst_uring_state = -1;
            return NULL;
        }
        r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
        r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
        r->sq_map = mmap(0, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
        r->cq_map = mmap(0, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
        r->sqes = (struct io_uring_sqe *)mmap(0, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
        if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
            if (r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
            if (r->cq_map != MAP_FAILED) munmap(r->cq_map, r->cq_len);
            if (r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
            close(r->fd);
            free(r);
            return NULL;
        }
        r->entries = p.sq_entries;
        r->generation = pst_ring_generation;
        r->sq_tail = (unsigned *)((char *)r->sq_map + p.sq_off.tail);
        r->sq_mask = (unsigned *)((char *)r->sq_map + p.sq_off.ring_mask);
        r->sq_array = (unsigned *)((char *)r->sq_map + p.sq_off.array);
        r->cq_head = (unsigned *)((char *)r->cq_map + p.cq_off.head);
        r->cq_tail = (unsigned *)((char *)r->cq_map + p.cq_off.tail);
        r->cq_mask = (unsigned *)((char *)r->cq_map + p.cq_off.ring_mask);
        r->cqes = (struct io_uring_cqe *)((char *)r->cq_map + p.cq_off.cqes);
        if (pthread_setspecific(pst_ring_key, r) != 0) { pst_ring_close(r); return NULL; }
        pst_uring_state = 1;
        return r;
    }

    /* The rest of a read the ring did not finish (a short read), by pread: 0, an errno or
       -1 (the file ends first). */
    static int pst_finish_read(int fd, char *buf, size_t want, int64_t at) {
        while (want > 0) {
            ssize_t got = pread(fd, buf, want, at);
            if (got < 0) { if (errno == EINTR) continue; return errno; }
            if (got == 0) return -1;
            buf += got; want -= (size_t)got; at += got;
        }
        return 0;
    }

    /* Records ``records[0:n]`` (ascending) of ``width`` bytes of file ``fd``, the first at
       byte ``offset``, into ``out`` (``n`` rows of ``width``): a read per run of neighbouring
       records, up to PST_RING_ENTRIES of them in flight. Returns 0, an errno, -1 for a short
       read (the file holds fewer records), or -2: no ring here (nothing was read). Every
       read submitted has completed when it returns, whatever it returns. */
    static int pst_uring_records(int fd, const int64_t *records, Py_ssize_t n, Py_ssize_t width,
                                 uint8_t *out, int64_t offset) {
        pst_ring *r = pst_ring_get();
        Py_ssize_t i = 0, j, in_flight = 0;
        int err = 0;
        if (r == NULL) return -2;
        while (i < n || in_flight > 0) {
            unsigned tail = *r->sq_tail;
            Py_ssize_t queued = 0, sent = 0;
            while (err == 0 && i < n && in_flight + queued < (Py_ssize_t)r->entries) {
                unsigned k = (tail + (unsigned)queued) & *r->sq_mask;
                struct io_uring_sqe *sqe = &r->sqes[k];
                j = i + 1;
                while (j < n && records[j] == records[j - 1] + 1 && (j + 1 - i) * width <= PST_MAX_READ
                       && j - i < 0xFFFFFF)
                    j++;
                memset(sqe, 0, sizeof *sqe);
                sqe->opcode = IORING_OP_READ;
                sqe->fd = fd;
                sqe->addr = (uint64_t)(uintptr_t)(out + i * width);
                sqe->len = (uint32_t)((j - i) * width);
                sqe->off = (uint64_t)(offset + records[i] * width);
                sqe->user_data = ((uint64_t)i << 24) | (uint64_t)(j - i);
                r->sq_array[k] = k;
                queued++;
                i = j;
            }
            if (queued == 0 && in_flight == 0) break;  /* (an error stopped the submissions) */
            if (queued) __atomic_store_n(r->sq_tail, tail + (unsigned)queued, __ATOMIC_RELEASE);
            for (int busy = 0;;) {  /* submit what is queued and wait for a completion at least */
                long got = syscall(__NR_io_uring_enter, r->fd, (unsigned)(queued - sent), 1u,
                                   IORING_ENTER_GETEVENTS, NULL, 0);
                if (got >= 0) {
                    sent += got;
                    if (sent >= queued) break;
                    continue;
                }
                if (errno == EINTR) continue;
                /* the kernel short of memory for the requests: a while, then refuse */
                if ((errno == EAGAIN || errno == EBUSY) && ++busy < PST_BUSY_TRIES) continue;
                if (err == 0) err = errno;  /* the ring refuses: what it took completes below */
                if (sent < queued) __atomic_store_n(r->sq_tail, tail + (unsigned)sent, __ATOMIC_RELEASE);
                break;
            }
            in_flight += sent;
            if (in_flight == 0) break;
            {
                unsigned head = *r->cq_head;
                unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
                while (head != ctail) {
                    struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
                    Py_ssize_t first = (Py_ssize_t)(cqe->user_data >> 24);
                    Py_ssize_t count = (Py_ssize_t)(cqe->user_data & 0xFFFFFF);
                    size_t want = (size_t)(count * width);
                    int res = cqe->res;
                    head++;
                    in_flight--;
                    if (err) continue;
                    if (res < 0) err = -res;
                    else if ((size_t)res < want)
                        err = pst_finish_read(fd, (char *)(out + first * width) + res, want - (size_t)res,
                                              offset + records[first] * width + res);
                }
                __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
            }
        }
        return err;
    }
    #else
    static volatile int pst_uring_state = -1;
    static int pst_uring_records(int fd, const int64_t *records, Py_ssize_t n, Py_ssize_t width,
                                 uint8_t *out, int64_t offset) { return -2; }
    #endif
    """
    int pst_uring_records(int fd, const int64_t* records, Py_ssize_t n, Py_ssize_t width, uint8_t* out, int64_t offset) nogil
    int pst_uring_state

import os as _os

#: Whether this process reads records through io_uring where the kernel has it (the
#: ``PSTRAIN_IO_URING`` variable: ``0`` turns it off).
_URING = _os.environ.get("PSTRAIN_IO_URING", "1") != "0"


def io_uring_reads():
    """Whether record reads (:func:`pread_records`) have gone through io_uring in this
    process: True once a ring worked, False once one could not be made (or
    ``PSTRAIN_IO_URING=0``), None before the first read."""
    if not _URING or pst_uring_state < 0:
        return False
    return True if pst_uring_state > 0 else None


def pread_records(
    int fd,
    const int64_t[::1] records,
    Py_ssize_t width,
    uint8_t[:, ::1] out,
    int64_t offset=0,
    bint uring=True,
):
    """Records ``records`` (ascending) of ``width`` bytes each of the file ``fd``, the first at
    byte ``offset`` (a column of a checkpoint file linked into a tier), into the rows of
    ``out``, without the GIL (a tiered table's rows read from disk). Through io_uring where
    the kernel has it (and ``uring``): a read per run of neighbouring records, many in
    flight at once (see above). Else by ``pread``: a run of neighbouring records is one
    call into ``out``; records a few apart (gaps of at most ``READ_GAP`` bytes) are read in
    one call of the span that holds them (at most ``READ_SPAN`` bytes, into a buffer of that
    size) and copied out: a call costs about what copying a few KiB does, so reading the
    dead records between live ones is cheaper than a call each. Returns 0, the errno of a
    failed read, or -1 for a short one (a file that holds fewer records than asked)."""
    cdef Py_ssize_t i = 0, j, k, n = records.shape[0]
    cdef ssize_t got, want
    cdef int64_t first
    cdef int err = 0
    cdef uint8_t *span = NULL
    if out.shape[0] < n or out.shape[1] != width:
        raise ValueError("pread_records: out must be (records, width)")
    if offset < 0:
        raise ValueError("pread_records: offset must be at least 0")
    if n == 0:
        return 0
    if uring and _URING:
        with nogil:
            err = pst_uring_records(fd, &records[0], n, width, &out[0, 0], offset)
        if err != -2 and err != EAGAIN and err != EBUSY:
            return err
        err = 0  # no ring here, or one the kernel had no memory for: the same reads by pread
    if width <= READ_SPAN:
        span = <uint8_t *>malloc(READ_SPAN)
        if span == NULL:
            raise MemoryError("pread_records: no memory for its read buffer")
    with nogil:
        while i < n:
            first = records[i]
            j = i + 1
            while j < n and records[j] == records[j - 1] + 1:
                j += 1
            if span != NULL:
                while (
                    j < n
                    and (records[j] - records[j - 1] - 1) * width <= READ_GAP
                    and (records[j] - first + 1) * width <= READ_SPAN
                ):
                    j += 1
            want = (records[j - 1] - first + 1) * width
            if want == (j - i) * width:  # neighbours only: straight into out
                got = pread(fd, &out[i, 0], want, offset + first * width)
            else:
                got = pread(fd, span, want, offset + first * width)
                if got == want:
                    for k in range(i, j):
                        memcpy(&out[k, 0], span + (records[k] - first) * width, width)
            if got != want:
                err = errno if got < 0 else -1
                break
            i = j
    free(span)
    return err


# -- strings: FarmHash's Fingerprint64 (farmhashna::Hash64), as TF's to_hash_bucket_fast ---------
# Written from the published algorithm; tests hold it to TensorFlow's own fingerprints and to
# the pure-Python version in reference.py.
cdef extern from *:
    """
    #define FH_K0 0xc3a5c85c97cb3127ULL
    #define FH_K1 0xb492b66fbe98f273ULL
    #define FH_K2 0x9ae16a3b2f90404fULL
    """
    const uint64_t FH_K0  # FarmHash's primes between 2**63 and 2**64
    const uint64_t FH_K1
    const uint64_t FH_K2


cdef inline uint64_t _fetch64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint64_t _fetch32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint64_t _rot(uint64_t v, int s) noexcept nogil:
    return v if s == 0 else (v >> s) | (v << (64 - s))


cdef inline uint64_t _smix(uint64_t v) noexcept nogil:
    return v ^ (v >> 47)


cdef inline uint64_t _h16(uint64_t u, uint64_t v, uint64_t mul) noexcept nogil:
    cdef uint64_t a = (u ^ v) * mul
    a ^= a >> 47
    cdef uint64_t b = (v ^ a) * mul
    b ^= b >> 47
    return b * mul


cdef inline uint64_t _len0to16(const uint8_t* s, uint64_t n) noexcept nogil:
    cdef uint64_t mul, a, b, c, d
    cdef uint32_t y, z
    if n >= 8:
        mul = FH_K2 + n * 2
        a = _fetch64(s) + FH_K2
        b = _fetch64(s + n - 8)
        c = _rot(b, 37) * mul + a
        d = (_rot(a, 25) + b) * mul
        return _h16(c, d, mul)
    if n >= 4:
        mul = FH_K2 + n * 2
        a = _fetch32(s)
        return _h16(n + (a << 3), _fetch32(s + n - 4), mul)
    if n > 0:
        y = <uint32_t>s[0] + (<uint32_t>s[n >> 1] << 8)
        z = <uint32_t>n + (<uint32_t>s[n - 1] << 2)
        return _smix(<uint64_t>y * FH_K2 ^ <uint64_t>z * FH_K0) * FH_K2
    return FH_K2


cdef inline uint64_t _len17to32(const uint8_t* s, uint64_t n) noexcept nogil:
    cdef uint64_t mul = FH_K2 + n * 2
    cdef uint64_t a = _fetch64(s) * FH_K1
    cdef uint64_t b = _fetch64(s + 8)
    cdef uint64_t c = _fetch64(s + n - 8) * mul
    cdef uint64_t d = _fetch64(s + n - 16) * FH_K2
    return _h16(_rot(a + b, 43) + _rot(c, 30) + d, a + _rot(b + FH_K2, 18) + c, mul)


cdef inline uint64_t _len33to64(const uint8_t* s, uint64_t n) noexcept nogil:
    cdef uint64_t mul = FH_K2 + n * 2
    cdef uint64_t a = _fetch64(s) * FH_K2
    cdef uint64_t b = _fetch64(s + 8)
    cdef uint64_t c = _fetch64(s + n - 8) * mul
    cdef uint64_t d = _fetch64(s + n - 16) * FH_K2
    cdef uint64_t y = _rot(a + b, 43) + _rot(c, 30) + d
    cdef uint64_t z = _h16(y, a + _rot(b + FH_K2, 18) + c, mul)
    cdef uint64_t e = _fetch64(s + 16) * mul
    cdef uint64_t f = _fetch64(s + 24)
    cdef uint64_t g = (y + _fetch64(s + n - 32)) * mul
    cdef uint64_t h = (z + _fetch64(s + n - 24)) * mul
    return _h16(_rot(e + f, 43) + _rot(g, 30) + h, e + _rot(f + a, 18) + g, mul)


cdef inline void _weak32(const uint8_t* s, uint64_t a, uint64_t b, uint64_t* first, uint64_t* second) noexcept nogil:
    cdef uint64_t w = _fetch64(s), x = _fetch64(s + 8), y = _fetch64(s + 16), z = _fetch64(s + 24)
    a += w
    b = _rot(b + a + z, 21)
    cdef uint64_t c = a
    a += x
    a += y
    b += _rot(a, 44)
    first[0] = a + z
    second[0] = b + c


cdef uint64_t _fingerprint64(const uint8_t* s, uint64_t n) noexcept nogil:
    if n <= 16:
        return _len0to16(s, n)
    if n <= 32:
        return _len17to32(s, n)
    if n <= 64:
        return _len33to64(s, n)
    cdef uint64_t seed = 81
    cdef uint64_t x = seed, y = seed * FH_K1 + 113
    cdef uint64_t z = _smix(y * FH_K2 + 113) * FH_K2
    cdef uint64_t v0 = 0, v1 = 0, w0 = 0, w1 = 0, t, mul
    x = x * FH_K2 + _fetch64(s)
    cdef const uint8_t* end = s + ((n - 1) // 64) * 64
    cdef const uint8_t* last64 = end + ((n - 1) & 63) - 63
    while True:
        x = _rot(x + y + v0 + _fetch64(s + 8), 37) * FH_K1
        y = _rot(y + v1 + _fetch64(s + 48), 42) * FH_K1
        x ^= w1
        y += v0 + _fetch64(s + 40)
        z = _rot(z + w0, 33) * FH_K1
        _weak32(s, v1 * FH_K1, x + w0, &v0, &v1)
        _weak32(s + 32, z + w1, y + _fetch64(s + 16), &w0, &w1)
        t = z
        z = x
        x = t
        s += 64
        if s == end:
            break
    mul = FH_K1 + ((z & 0xff) << 1)
    s = last64
    w0 += (n - 1) & 63
    v0 += w0
    w0 += v0
    x = _rot(x + y + v0 + _fetch64(s + 8), 37) * mul
    y = _rot(y + v1 + _fetch64(s + 48), 42) * mul
    x ^= w1 * 9
    y += v0 * 9 + _fetch64(s + 40)
    z = _rot(z + w0, 33) * mul
    _weak32(s, v1 * mul, x + w0, &v0, &v1)
    _weak32(s + 32, z + w1, y + _fetch64(s + 16), &w0, &w1)
    t = z
    z = x
    x = t
    return _h16(_h16(v0, w0, mul) + _smix(y) * FH_K0 + z, _h16(v1, w1, mul) + x, mul)


cdef inline uint64_t _rotl(uint64_t v, int s) noexcept nogil:
    return (v << s) | (v >> (64 - s))


cdef inline void _sipround(uint64_t* v) noexcept nogil:
    v[0] += v[1]
    v[1] = _rotl(v[1], 13)
    v[1] ^= v[0]
    v[0] = _rotl(v[0], 32)
    v[2] += v[3]
    v[3] = _rotl(v[3], 16)
    v[3] ^= v[2]
    v[0] += v[3]
    v[3] = _rotl(v[3], 21)
    v[3] ^= v[0]
    v[2] += v[1]
    v[1] = _rotl(v[1], 17)
    v[1] ^= v[2]
    v[2] = _rotl(v[2], 32)


cdef uint64_t _siphash24(const uint8_t* s, uint64_t n, uint64_t k0, uint64_t k1) noexcept nogil:
    cdef uint64_t v[4]
    v[0] = k0 ^ 0x736f6d6570736575ULL
    v[1] = k1 ^ 0x646f72616e646f6dULL
    v[2] = k0 ^ 0x6c7967656e657261ULL
    v[3] = k1 ^ 0x7465646279746573ULL
    cdef uint64_t m, last = n << 56
    cdef uint64_t i, whole = n - (n & 7)
    i = 0
    while i < whole:
        m = _fetch64(s + i)
        v[3] ^= m
        _sipround(v)
        _sipround(v)
        v[0] ^= m
        i += 8
    for i in range(n & 7):
        last |= (<uint64_t>s[whole + i]) << (8 * i)
    v[3] ^= last
    _sipround(v)
    _sipround(v)
    v[0] ^= last
    v[2] ^= 0xff
    for i in range(4):
        _sipround(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


cdef uint32_t _CRC32C[8][256]  # slice by 8: table k advances a byte k places further


cdef void _crc32c_tables() noexcept:
    cdef uint32_t i, j, c
    for i in range(256):
        c = i
        for j in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        _CRC32C[0][i] = c
    for i in range(256):
        for j in range(1, 8):
            _CRC32C[j][i] = (_CRC32C[j - 1][i] >> 8) ^ _CRC32C[0][_CRC32C[j - 1][i] & 0xFF]


_crc32c_tables()


cdef uint32_t _crc32c(const uint8_t* p, Py_ssize_t n, uint32_t crc) noexcept nogil:
    """CRC-32C of ``n`` bytes at ``p``, continuing ``crc``: eight bytes a step (Intel's
    slicing-by-8), then the rest a byte at a time."""
    cdef uint32_t c = ~crc
    cdef uint64_t w
    while n >= 8:
        memcpy(&w, p, 8)
        w ^= c
        c = (_CRC32C[7][w & 0xFF] ^ _CRC32C[6][(w >> 8) & 0xFF] ^ _CRC32C[5][(w >> 16) & 0xFF]
             ^ _CRC32C[4][(w >> 24) & 0xFF] ^ _CRC32C[3][(w >> 32) & 0xFF] ^ _CRC32C[2][(w >> 40) & 0xFF]
             ^ _CRC32C[1][(w >> 48) & 0xFF] ^ _CRC32C[0][w >> 56])
        p += 8
        n -= 8
    while n > 0:
        c = _CRC32C[0][(c ^ p[0]) & 0xFF] ^ (c >> 8)
        p += 1
        n -= 1
    return ~c


def crc32c(const uint8_t[::1] data, uint32_t crc=0):
    """CRC-32C (Castagnoli) of ``data``, continuing ``crc``: the checksum of TFRecord files
    (and of TensorBoard's event files)."""
    cdef uint32_t out
    with nogil:
        out = _crc32c(&data[0] if data.shape[0] else <const uint8_t*>b"", data.shape[0], crc)
    return out


cdef inline uint32_t _masked_crc(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint32_t crc = _crc32c(p, n, 0)
    return ((crc >> 15) | (crc << 17)) + 0xA282EAD8U


def tfrecord_split(const uint8_t[::1] buf):
    """The whole TFRecord records at the start of ``buf``, each checked against its masked
    CRC-32C: ``(records, used, problem, at, need)``. ``used``: the bytes they take;
    ``problem``: 0, or 1 (a length's checksum) or 2 (a data's) for the record at ``at``;
    ``need``: the bytes still to come for the record after them (0 when its header is not
    whole yet)."""
    cdef Py_ssize_t n = buf.shape[0], at = 0
    cdef uint64_t length
    cdef uint32_t crc
    cdef const uint8_t* p = &buf[0] if n else <const uint8_t*>b""
    records = []
    while n - at >= 12:
        memcpy(&length, p + at, 8)
        memcpy(&crc, p + at + 8, 4)
        if _masked_crc(p + at, 8) != crc:
            return records, at, 1, at, 0
        if length > <uint64_t>(n - at) or <uint64_t>(n - at) - length < 16:  # not all here yet
            if length > <uint64_t>(INT64_MAX - 16):
                return records, at, 0, at, INT64_MAX
            return records, at, 0, at, <Py_ssize_t>(length + 16) - (n - at)
        memcpy(&crc, p + at + 12 + length, 4)
        if _masked_crc(p + at + 12, <Py_ssize_t>length) != crc:
            return records, at, 2, at, 0
        records.append(bytes(buf[at + 12 : at + 12 + <Py_ssize_t>length]))
        at += 16 + <Py_ssize_t>length
    return records, at, 0, at, 0


cdef inline bint _varint(const uint8_t* p, Py_ssize_t n, Py_ssize_t* i, uint64_t* out) noexcept nogil:
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef uint8_t b
    while True:
        if i[0] >= n or shift > 63:
            return False
        b = p[i[0]]
        i[0] += 1
        v |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
    out[0] = v
    return True


cdef inline bint _skip_field(const uint8_t* p, Py_ssize_t n, Py_ssize_t* i, uint64_t wire) noexcept nogil:
    cdef uint64_t v
    if wire == 0:
        return _varint(p, n, i, &v)
    if wire == 1 or wire == 5:
        i[0] += 8 if wire == 1 else 4
        return i[0] <= n
    if wire == 2:
        if not _varint(p, n, i, &v) or v > <uint64_t>(n - i[0]):
            return False
        i[0] += <Py_ssize_t>v
        return True
    return False


cdef inline bint _delimited(const uint8_t* p, Py_ssize_t n, Py_ssize_t* i, Py_ssize_t* start, Py_ssize_t* end) noexcept nogil:
    cdef uint64_t v
    if not _varint(p, n, i, &v) or v > <uint64_t>(n - i[0]):
        return False
    start[0] = i[0]
    end[0] = i[0] + <Py_ssize_t>v
    i[0] = end[0]
    return True


cdef object _not_example(Py_ssize_t r, str why):
    return ValueError(f"record {r} is not a tf.train.Example ({why})")


cdef int _next_message(const uint8_t* p, Py_ssize_t end, Py_ssize_t* i, Py_ssize_t* start, Py_ssize_t* stop) noexcept nogil:
    """Find the next field 1 of a message (a length-delimited one) from ``i[0]``, skipping
    the others: 1 with its bytes in ``[start, stop)``, 0 at the message's end, -1 if cut."""
    cdef uint64_t tag
    while i[0] < end:
        if not _varint(p, end, i, &tag):
            return -1
        if tag >> 3 == 1 and tag & 7 == 2:
            return 1 if _delimited(p, end, i, start, stop) else -1
        if not _skip_field(p, end, i, tag & 7):
            return -1
    return 0


cdef class _Numbers:
    """A growing buffer of int64 or float32 values (a feature's, over a batch)."""
    cdef char* data
    cdef Py_ssize_t used, capacity, itemsize

    def __cinit__(self, Py_ssize_t itemsize):
        self.itemsize = itemsize
        self.data = NULL
        self.used = self.capacity = 0

    def __dealloc__(self):
        free(self.data)

    cdef int room(self, Py_ssize_t more) except -1:
        cdef Py_ssize_t want = self.used + more, capacity = max(self.capacity * 2, 1024)
        cdef char* grown
        if want <= self.capacity:
            return 0
        while capacity < want:
            capacity *= 2
        grown = <char*>realloc(self.data, capacity * self.itemsize)
        if grown == NULL:
            raise MemoryError()
        self.data, self.capacity = grown, capacity
        return 0

    def array(self):
        out = np.empty(self.used, np.int64 if self.itemsize == 8 else np.float32)
        if self.used:
            memcpy(cnp.PyArray_DATA(out), self.data, self.used * self.itemsize)
        return out


_LIST_NAMES = {1: "bytes_list", 2: "float_list", 3: "int64_list"}


def parse_examples(list records, dict keys, bytes kinds):
    """Serialized ``tf.train.Example``\\ s read straight from the protobuf wire format: for
    feature ``f`` (``keys[name] = f``; ``kinds[f]``: ``b"b"`` bytes, ``b"f"`` float32,
    ``b"i"`` int64), its values over the records end to end and each record's count (-1
    where the record does not have it). As protobuf reads them: the last of a repeated map
    key or list kind wins, packed and unpacked lists alike, unknown fields skipped; a
    feature with no list is missing (TF's). A record that is not one, or a feature of
    another kind, is a ``ValueError`` naming the record (and the feature)."""
    cdef Py_ssize_t nf = len(kinds), nr = len(records), k
    cdef const uint8_t* kp = <const uint8_t*>kinds
    if any(kind not in b"bfi" for kind in kinds):
        raise ValueError(f"parse_examples: kinds must be b (bytes), f (float32) or i (int64), got {kinds!r}")
    counts = np.full((nf, nr), -1, np.int64)
    cdef int64_t[:, ::1] c = counts
    numbers = [None if kinds[k] == ord("b") else _Numbers(8 if kinds[k] == ord("i") else 4) for k in range(nf)]
    strings = [[] if kinds[k] == ord("b") else None for k in range(nf)]
    names = [None] * nf  # the keys' bytes, kept alive while their pointers are used
    for name, index in keys.items():
        if not isinstance(name, bytes) or not 0 <= index < nf or names[index] is not None:
            raise ValueError("parse_examples: keys must map each feature's name (bytes) to its index once")
        names[index] = name
    if any(name is None for name in names):
        raise ValueError("parse_examples: a feature without a name")
    cdef const char** key_data = <const char**>malloc(max(nf, 1) * sizeof(char*))
    cdef Py_ssize_t* key_lengths = <Py_ssize_t*>malloc(max(nf, 1) * sizeof(Py_ssize_t))
    if key_data == NULL or key_lengths == NULL:
        free(key_data)
        free(key_lengths)
        raise MemoryError()
    for k in range(nf):
        key_data[k] = <const char*>(<bytes>names[k])
        key_lengths[k] = len(<bytes>names[k])
    try:
        _parse_records(records, nf, nr, kp, key_data, key_lengths, c, numbers, strings)
    finally:
        free(key_data)
        free(key_lengths)
    values = []
    for k in range(nf):
        if kinds[k] == ord("b"):
            arr = np.empty(len(strings[k]), object)  # (np.array would make bytes of a fixed width)
            arr[:] = strings[k]
            values.append(arr)
        else:
            values.append((<_Numbers>numbers[k]).array())
    return values, counts


cdef int _parse_records(
    list records,
    Py_ssize_t nf,
    Py_ssize_t nr,
    const uint8_t* kp,
    const char** key_data,
    Py_ssize_t* key_lengths,
    int64_t[:, ::1] c,
    list numbers,
    list strings,
) except -1:
    cdef Py_ssize_t r, f, i, n, fs, fe, es, ee, ks, ke, vs, ve, ls, le, j, i2, count, k, probe, hint = 0
    cdef int found
    cdef uint64_t tag, field, wire, v, kind
    cdef int want
    cdef bint ok
    cdef const uint8_t* p
    cdef const unsigned char[::1] view
    cdef _Numbers acc
    for r in range(nr):
        record = records[r]
        view = record
        n = view.shape[0]
        p = &view[0] if n else <const uint8_t*>b""
        i = 0
        while True:  # Example: its Features (field 1), as many as there are
            found = _next_message(p, n, &i, &fs, &fe)
            if found < 0:
                raise _not_example(r, "its features are cut")
            if not found:
                break
            j = fs
            while True:  # Features: its map entries (field 1)
                found = _next_message(p, fe, &j, &es, &ee)
                if found < 0:
                    raise _not_example(r, "a feature is cut")
                if not found:
                    break
                ks = ke = vs = ve = es  # an entry: its key (1) and its value (2), the last of each
                i2 = es
                while i2 < ee:
                    if not _varint(p, ee, &i2, &tag):
                        raise _not_example(r, "a feature's entry is cut")
                    field, wire = tag >> 3, tag & 7
                    if (field == 1 or field == 2) and wire == 2:
                        if field == 1:
                            ok = _delimited(p, ee, &i2, &ks, &ke)
                        else:
                            ok = _delimited(p, ee, &i2, &vs, &ve)
                    else:
                        ok = _skip_field(p, ee, &i2, wire)
                    if not ok:
                        raise _not_example(r, "a feature's entry is cut")
                # which feature: the one after the last found first (records written alike
                # keep their keys in one order), then every other, by length and bytes
                f = -1
                for probe in range(nf):
                    k = hint + probe
                    if k >= nf:
                        k -= nf
                    if key_lengths[k] == ke - ks and memcmp(key_data[k], p + ks, ke - ks) == 0:
                        f = k
                        break
                if f < 0:
                    continue
                hint = f + 1 if f + 1 < nf else 0
                kind, ls, le = 0, vs, vs  # the Feature: its list (the last kind given wins)
                i2 = vs
                while i2 < ve:
                    if not _varint(p, ve, &i2, &tag):
                        raise _not_example(r, "a feature's value is cut")
                    field, wire = tag >> 3, tag & 7
                    if 1 <= field <= 3 and wire == 2:
                        ok = _delimited(p, ve, &i2, &ls, &le)
                        kind = field
                    else:
                        ok = _skip_field(p, ve, &i2, wire)
                    if not ok:
                        raise _not_example(r, "a feature's value is cut")
                want = 1 if kp[f] == ord("b") else 2 if kp[f] == ord("f") else 3
                if kind != 0 and kind != want:
                    raise ValueError(
                        f"record {r}, feature {bytes(record[ks:ke]).decode('utf-8', 'replace')!r}: data types "
                        f"don't match: it holds {_LIST_NAMES[kind]}, the spec asks for {_LIST_NAMES[want]}"
                    )
                if c[f, r] >= 0:  # the key came before in this record: the last one wins
                    if want == 1:
                        del strings[f][len(strings[f]) - c[f, r]:]
                    else:
                        acc = numbers[f]
                        acc.used -= c[f, r]
                    c[f, r] = -1
                if kind == 0:  # no list: the feature is missing, as TF takes it
                    continue
                count = 0
                i2 = ls
                if want == 1:
                    out = strings[f]
                    while i2 < le:
                        if not _varint(p, le, &i2, &tag):
                            raise _not_example(r, "a bytes list is cut")
                        if tag >> 3 == 1 and tag & 7 == 2:
                            if not _delimited(p, le, &i2, &es, &ee):
                                raise _not_example(r, "a bytes value is cut")
                            out.append(bytes(record[es:ee]))
                            count += 1
                        elif not _skip_field(p, le, &i2, tag & 7):
                            raise _not_example(r, "a bytes list is cut")
                else:
                    acc = numbers[f]
                    while i2 < le:
                        if not _varint(p, le, &i2, &tag):
                            raise _not_example(r, "a list is cut")
                        field, wire = tag >> 3, tag & 7
                        if field != 1:
                            if not _skip_field(p, le, &i2, wire):
                                raise _not_example(r, "a list is cut")
                            continue
                        if want == 3 and wire == 0:  # one int64
                            if not _varint(p, le, &i2, &v):
                                raise _not_example(r, "an int64 is cut")
                            acc.room(1)
                            (<int64_t*>acc.data)[acc.used] = <int64_t>v
                            acc.used += 1
                            count += 1
                        elif want == 2 and wire == 5:  # one float
                            if i2 + 4 > le:
                                raise _not_example(r, "a float is cut")
                            acc.room(1)
                            memcpy(&(<float*>acc.data)[acc.used], p + i2, 4)
                            i2 += 4
                            acc.used += 1
                            count += 1
                        elif wire == 2:  # packed
                            if not _delimited(p, le, &i2, &es, &ee):
                                raise _not_example(r, "a packed list is cut")
                            if want == 2:
                                if (ee - es) % 4:
                                    raise _not_example(r, "a float list is cut")
                                acc.room((ee - es) // 4)
                                memcpy(&(<float*>acc.data)[acc.used], p + es, ee - es)
                                acc.used += (ee - es) // 4
                                count += (ee - es) // 4
                            else:
                                while es < ee:
                                    if not _varint(p, ee, &es, &v):
                                        raise _not_example(r, "an int64 is cut")
                                    acc.room(1)
                                    (<int64_t*>acc.data)[acc.used] = <int64_t>v
                                    acc.used += 1
                                    count += 1
                        else:
                            raise _not_example(r, f"a list value of wire type {wire}")
                c[f, r] = count
    return 0


cdef Py_ssize_t _strings_checked(const uint8_t[::1] data, const int64_t[::1] offsets, str what) except -1:
    """The number of strings ``data[offsets[i]:offsets[i + 1]]``, each checked to lie in
    ``data`` (the hashes' arguments)."""
    cdef Py_ssize_t i, n = offsets.shape[0] - 1
    if n < 0:
        raise ValueError(f"{what}: offsets must hold at least one number")
    for i in range(n):
        if offsets[i] < 0 or offsets[i + 1] < offsets[i] or offsets[i + 1] > data.shape[0]:
            raise ValueError(f"{what}: offsets outside the data or decreasing")
    return n


def siphash24(const uint8_t[::1] data, const int64_t[::1] offsets, uint64_t k0, uint64_t k1):
    """SipHash-2-4 with the key ``(k0, k1)`` of each string ``data[offsets[i]:offsets[i + 1]]``
    (uint64): TensorFlow's ``tf.strings.to_hash_bucket_strong`` hash (its ``key``), whose
    remainder is the bucket; Keras' ``Hashing`` with a ``salt``."""
    cdef Py_ssize_t i, n = _strings_checked(data, offsets, "siphash24")
    out = np.empty(n, np.uint64)
    cdef uint64_t[::1] o = out
    cdef const uint8_t* base = &data[0] if data.shape[0] else <const uint8_t*>b""
    with nogil:
        for i in range(n):
            o[i] = _siphash24(base + offsets[i], <uint64_t>(offsets[i + 1] - offsets[i]), k0, k1)
    return out


def fingerprint64(const uint8_t[::1] data, const int64_t[::1] offsets):
    """FarmHash's Fingerprint64 of each string ``data[offsets[i]:offsets[i + 1]]`` (uint64):
    TensorFlow's ``tf.fingerprint(..., "farmhash64")`` of a string, whose remainder is
    ``tf.strings.to_hash_bucket_fast``'s bucket."""
    cdef Py_ssize_t i, n = _strings_checked(data, offsets, "fingerprint64")
    out = np.empty(n, np.uint64)
    cdef uint64_t[::1] o = out
    cdef const uint8_t* base = &data[0] if data.shape[0] else <const uint8_t*>b""
    with nogil:
        for i in range(n):
            o[i] = _fingerprint64(base + offsets[i], <uint64_t>(offsets[i + 1] - offsets[i]))
    return out
