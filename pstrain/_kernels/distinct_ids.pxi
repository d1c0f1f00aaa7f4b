# Included by compiled.pyx: a batch's distinct ids (first seen, or sorted within a span), a
# stable sort of ids by a radix sort, and ids split among shards.

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
