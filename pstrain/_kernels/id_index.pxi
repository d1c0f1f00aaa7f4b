# Included by compiled.pyx: the id indexes. An id index's slots (id and value side by side,
# linear probing from the id's hash), the compact index of the rows on disk, a batch's set of
# ids, and the sightings a table counts before it admits an id.

# An id index's slot is (id, value), side by side, one probe one cache line: a value of
# EMPTY marks a slot without an id (a deletion leaves no tombstone).
DEF EMPTY = -1


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


cdef inline void _compact_prefetch_first(const int64_t* k, const uint32_t* v, uint64_t size,
                                         const int64_t[::1] ids) noexcept nogil:
    """Ask for the first ``PROBE_AHEAD`` ids' slots before a loop that asks for each next
    one that far ahead: a part of a partitioned index gets a few dozen ids a request, whose
    first probes would otherwise each wait for memory in turn."""
    cdef Py_ssize_t i
    for i in range(min(ids.shape[0], PROBE_AHEAD)):
        _compact_prefetch(k, v, size, ids[i])


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
        _compact_prefetch_first(k, v, size, ids)
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
        _compact_prefetch_first(k, v, size, ids)
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
        _compact_prefetch_first(k, v, size, ids)
        for i in range(n):
            if i + PROBE_AHEAD < n:  # (a cache miss each, as a get's: asked for ahead)
                _compact_prefetch(k, v, size, ids[i + PROBE_AHEAD])
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
