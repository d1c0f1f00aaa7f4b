# Included by compiled.pyx: a table's rows. Gathers and puts by position, an update's row
# order, the epochs that stamp changed rows (for deltas), an eviction's victims, and the rows
# changed since an epoch.

#: Buckets of the key histograms that narrow down an eviction's victims.
DEF BUCKETS = 65536


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


def flag_rows(uint8_t[::1] bits, const int64_t[::1] pos, Py_ssize_t rows):
    """An update's bookkeeping between a store's marks: set the bit of each row ``pos[i] >= 0`` of a
    table of ``rows`` rows (row ``r``: bit ``r % 8`` of byte ``r // 8``); returns how many
    rows that is. A bit a row where :func:`stamp_rows` writes 4 bytes: a million rows' bits
    are 125 kB, which stay in the caches that an update's scattered epochs miss."""
    cdef Py_ssize_t i, k = 0, n = pos.shape[0]
    cdef int64_t r
    if bits.shape[0] != (rows + 7) // 8:
        raise ValueError(f"flag_rows: {bits.shape[0]} bytes of bits for {rows} rows")
    if _past_end(pos, rows):
        raise IndexError("flag_rows: a row past the table's end")
    with nogil:
        for i in range(n):
            r = pos[i]
            if r >= 0:
                bits[r >> 3] |= <uint8_t>(1 << (r & 7))
                k += 1
    return k


def stamp_flagged(uint8_t[::1] bits, uint32_t[::1] epochs, uint32_t epoch):
    """Stamp every row whose bit is set with ``epoch`` (what :func:`stamp_rows` would have
    written as each changed) and clear the bits; returns how many rows that is. One pass
    over the bits, eight bytes at a time: most are 0."""
    cdef Py_ssize_t i, j, k = 0, nbytes = bits.shape[0], rows = epochs.shape[0]
    cdef uint64_t w
    cdef uint8_t* p
    if nbytes != (rows + 7) // 8:
        raise ValueError(f"stamp_flagged: {nbytes} bytes of bits for {rows} rows")
    if nbytes == 0:
        return 0
    p = &bits[0]
    with nogil:
        i = 0
        while i < nbytes:
            if i + 8 <= nbytes:
                memcpy(&w, p + i, 8)
                if w == 0:
                    i += 8
                    continue
            j = min(i + 8, nbytes)
            while i < j:
                w = p[i]
                while w:
                    epochs[i * 8 + __builtin_ctzll(w)] = epoch
                    k += 1
                    w &= w - 1
                p[i] = 0
                i += 1
    return k


cdef inline uint64_t _shift(uint64_t span) noexcept nogil:
    """The bits a key's offset drops for ``span + 1`` keys to fit the histogram's buckets."""
    cdef uint64_t shift = 0
    while (span >> shift) >= BUCKETS:
        shift += 1
    return shift


cdef int64_t _nth_smallest(const int64_t[::1] value, const uint8_t[::1] live,
                           const uint8_t[::1] mark, Py_ssize_t limit, bint among,
                           const int64_t[::1] key, int64_t key_value, Py_ssize_t n,
                           int64_t lo, int64_t hi, bint filled, int64_t[::1] hist,
                           Py_ssize_t* need_out) noexcept nogil:
    """The ``n``-th smallest ``value`` (0 < n < the rows counted) of the live rows not
    marked (``among``: only those whose ``key`` is ``key_value``), all in [``lo``, ``hi``]:
    histograms narrow the range to the bucket holding it until a bucket is one value wide
    (``filled``: the first histogram, over that range, is in ``hist`` already).
    ``need_out``: how many rows of that value are taken."""
    cdef Py_ssize_t r, b, nb, need = n
    cdef int64_t k
    cdef uint64_t shift
    while True:
        shift = _shift(<uint64_t>hi - <uint64_t>lo)
        nb = <Py_ssize_t>((<uint64_t>hi - <uint64_t>lo) >> shift) + 1
        if not filled:
            for b in range(nb):
                hist[b] = 0
            for r in range(limit):
                if live[r] and not mark[r] and (not among or key[r] == key_value):
                    k = value[r]
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
    need_out[0] = need
    return lo


def pick_victims(const int64_t[::1] key, const uint8_t[::1] live, const int64_t[::1] protect,
                 uint8_t[::1] mark, Py_ssize_t used, Py_ssize_t n, int64_t low=0, int64_t high=-1,
                 const int64_t[::1] tiebreak=None):
    """The rows an eviction of ``n`` takes: of the rows below ``used`` that are ``live`` and
    not in ``protect``, the ``n`` of smallest ``key`` (the last lookup for LRU, the count for
    LFU), ties at the boundary going to the rows of smallest ``tiebreak`` (LFU's: the last
    lookup), then to the lowest rows; ascending. ``mark`` is the table's byte per row, all 0
    (and again after). Histograms of the keys narrow down the n-th smallest (a few passes
    over the rows, no sort), and of the tied rows' ``tiebreak`` the same. Keys known to lie
    in [``low``, ``high``] (LRU's: no later than the clock) spare the pass that finds their
    range; a key outside it, or ``high < low``, and that pass runs."""
    cdef Py_ssize_t r, i, count = 0, limit = min(used, min(key.shape[0], min(live.shape[0], mark.shape[0])))
    cdef int64_t lo = 0, hi = 0, k, threshold, second = 0
    cdef Py_ssize_t need = 0, ties, tied = 0, second_ties = 0
    cdef uint64_t shift
    cdef bint bad = False, filled = False, by_tiebreak = False
    if tiebreak is not None and tiebreak.shape[0] < limit:
        raise ValueError("pick_victims: tiebreak is shorter than the rows it orders")
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
        if 0 < n < count:
            # the n-th smallest key; ``need`` rows of it are taken, the lowest first
            threshold = _nth_smallest(key, live, mark, limit, False, key, 0, n, lo, hi, filled, hist, &need)
            if tiebreak is not None:  # or, when more rows tie, those of smallest tiebreak
                for r in range(limit):
                    if live[r] and not mark[r] and key[r] == threshold:
                        k = tiebreak[r]
                        if tied == 0 or k < lo:
                            lo = k
                        if tied == 0 or k > hi:
                            hi = k
                        tied += 1
                if tied > need:
                    by_tiebreak = True
                    second = _nth_smallest(tiebreak, live, mark, limit, True, key, threshold, need,
                                           lo, hi, False, hist, &second_ties)
            i = 0
            ties = need
            for r in range(limit):
                if live[r] and not mark[r]:
                    k = key[r]
                    if k < threshold:
                        o[i] = r
                        i += 1
                    elif k == threshold and ties > 0:
                        if by_tiebreak:
                            if tiebreak[r] > second or (tiebreak[r] == second and second_ties == 0):
                                continue
                            if tiebreak[r] == second:
                                second_ties -= 1
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


def decode_places(const uint32_t[::1] codes, int bits, const int64_t[::1] numbers,
                  const int64_t[::1] firsts):
    """The places ``codes`` hold (a tier's :class:`~pstrain.server.ps.tables.cold_places.Places`,
    a code a cold slot): a code is a handle (``code >> bits``) and a record within its run
    (``code & (2**bits - 1)``), read back as ``numbers[handle] << 32 | firsts[handle] +
    record``; the code 0xFFFFFFFF (a slot not in use) as -1. A handle never given is an
    IndexError."""
    cdef Py_ssize_t i, n = codes.shape[0], handles = numbers.shape[0]
    cdef uint32_t c, free_code = 0xFFFFFFFF
    cdef uint32_t mask = (<uint32_t>1 << bits) - 1 if 0 < bits < 32 else 0
    cdef int64_t h
    cdef bint bad = False
    if not 0 < bits < 32:
        raise ValueError(f"decode_places: bits must be in 1..31, got {bits}")
    if firsts.shape[0] != handles:
        raise ValueError("decode_places: numbers and firsts differ in length")
    out = np.empty(n, np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        for i in range(n):
            c = codes[i]
            if c == free_code:
                o[i] = -1
                continue
            h = c >> bits
            if h >= handles:
                bad = True
                break
            o[i] = (numbers[h] << 32) | (firsts[h] + (c & mask))
    if bad:
        raise IndexError("decode_places: a code whose handle was never given")
    return out


def mark_bits(uint8_t[::1] bits, const int64_t[::1] slots, const uint8_t[::1] on):
    """Bit ``slots[i]`` of ``bits`` (bit ``s % 8`` of byte ``s // 8``: a tier's bit a cold
    slot) set where ``on[i]``, cleared elsewhere (everywhere if ``on`` is empty); ``slots``
    unique. A slot past the bits is refused before any is written."""
    cdef Py_ssize_t i, n = slots.shape[0], size = bits.shape[0]
    cdef bint setting = on.shape[0] != 0
    cdef int64_t s
    if setting and on.shape[0] != n:
        raise ValueError(f"mark_bits: {n} slots but {on.shape[0]} answers")
    for i in range(n):
        if slots[i] < 0 or (slots[i] >> 3) >= size:
            raise IndexError("mark_bits: a slot past the bits")
    with nogil:
        for i in range(n):
            s = slots[i]
            if setting and on[i]:
                bits[s >> 3] |= <uint8_t>(1 << (s & 7))
            else:
                bits[s >> 3] &= <uint8_t>~(1 << (s & 7))
