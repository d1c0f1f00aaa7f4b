# Included by compiled.pyx: a batch's distinct ids (first seen, sorted within a span, or
# sorted by a packed sort), a stable sort of ids by a radix sort, and ids split among
# shards.

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


def id_span(const int64_t[::1] ids, bint unsigned=False):
    """``(least, greatest, strictly ascending)`` of ``ids`` (at least one; as uint64 if
    ``unsigned``), in one pass: what :func:`~pstrain._kernels.batches.distinct` asks before
    it chooses how to find the distinct ids, where numpy took three."""
    cdef Py_ssize_t n = ids.shape[0], i
    cdef uint64_t flip = 0 if unsigned else (<uint64_t>1) << 63
    cdef uint64_t a, b, lo, hi, lo2, hi2
    cdef bint up = True, up2 = True
    if n == 0:
        raise ValueError("id_span: no ids")
    with nogil:  # (two ids a step, each pair's own least and greatest: no chain to wait on)
        lo = hi = lo2 = hi2 = <uint64_t>ids[0] ^ flip
        for i in range(1, n - 1, 2):
            a = <uint64_t>ids[i] ^ flip
            b = <uint64_t>ids[i + 1] ^ flip
            up &= a > (<uint64_t>ids[i - 1] ^ flip)
            up2 &= b > a
            lo = a if a < lo else lo
            hi = a if a > hi else hi
            lo2 = b if b < lo2 else lo2
            hi2 = b if b > hi2 else hi2
        if n % 2 == 0:  # the last, left over
            a = <uint64_t>ids[n - 1] ^ flip
            up &= a > (<uint64_t>ids[n - 2] ^ flip)
            lo = a if a < lo else lo
            hi = a if a > hi else hi
        lo = lo2 if lo2 < lo else lo
        hi = hi2 if hi2 > hi else hi
        up = up and up2
    if unsigned:
        return lo, hi, up
    return <int64_t>(lo ^ flip), <int64_t>(hi ^ flip), up


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


# Runs of ids the packed sort left unordered (ids sharing their high bits, past the bits
# the packing kept) up to this long are sorted in place; longer ones by numpy.
cdef Py_ssize_t INSERTION_RUN = 32


def unique_sorted(const int64_t[::1] ids, bint unsigned=False, object span=None):
    """``(unique ascending, inverse)``: the distinct ids ascending (as uint64 if
    ``unsigned``), and for each id its position among them, as ``np.unique(ids,
    return_inverse=True)`` gives them. ``span``: their least and greatest as
    :func:`id_span` gives them, if the caller has them (else found here).

    Each id's offset from the least is packed with its position into one 64-bit word (the
    offset's low bits dropped if both do not fit), the words sorted by numpy (its
    vectorized sort of 64-bit integers), and the ids read in that order, without a branch.
    Words whose kept bits tie are in the order of their positions, not of their ids: where
    that puts an id after a greater one, the runs of ties are put in order and the ids read
    again. Measured on W6's batches of 13,312 ids over the 64-bit space (about 6,900
    distinct): 0.4x the time of the hash pass and radix argsort it replaced."""
    cdef Py_ssize_t n = ids.shape[0], i, j, e, t
    cdef uint64_t flip = 0 if unsigned else (<uint64_t>1) << 63
    cdef uint64_t lo, hi, extent, mask
    cdef int bits = 1, width = 0, shift = 0
    inverse = np.empty(n, np.int64)
    if n == 0:
        return np.empty(0, np.int64), inverse
    least, greatest = id_span(ids, unsigned)[:2] if span is None else span
    if unsigned:  # (flipped, signed order is unsigned order)
        lo, hi = <uint64_t>least, <uint64_t>greatest
    else:
        lo, hi = <uint64_t><int64_t>least ^ flip, <uint64_t><int64_t>greatest ^ flip
    while bits < 63 and ((<uint64_t>1) << bits) < <uint64_t>n:
        bits += 1
    extent = hi - lo
    if extent:
        width = 64 - __builtin_clzll(extent)
    if width > 64 - bits:
        shift = width - (64 - bits)
    mask = ((<uint64_t>1) << bits) - 1
    packed = np.empty(n, np.uint64)
    unique = np.empty(n, np.int64)
    cdef uint64_t[::1] pk = packed
    cdef int64_t[::1] u = unique, inv = inverse
    cdef Py_ssize_t m
    with nogil:
        for i in range(n):
            pk[i] = ((((<uint64_t>ids[i] ^ flip) - lo) >> shift) << bits) | <uint64_t>i
    packed.sort()  # (numpy's: vectorized for 64-bit integers where the CPU has it)
    with nogil:
        m = _read_in_order(&pk[0], n, mask, &ids[0], flip, &u[0], &inv[0])
    if m < 0:  # ties out of order: each run of them sorted by its ids
        j = 0
        while j < n:
            with nogil:
                while j < n:
                    e = j + 1
                    while e < n and (pk[e] >> bits) == (pk[j] >> bits):
                        e += 1
                    if e - j > 1 and not _order_run(&pk[0], j, e, mask, &ids[0], flip):
                        break  # (too long to sort here)
                    j = e
            if j < n:
                run = packed[j:e]
                keys = np.asarray(ids).take((run & np.uint64(mask)).astype(np.intp)).view(np.uint64)
                packed[j:e] = run[np.argsort(keys ^ np.uint64(flip), kind="stable")]
                j = e
        with nogil:
            m = _read_in_order(&pk[0], n, mask, &ids[0], flip, &u[0], &inv[0])
    return unique[:m].copy(), inverse


cdef Py_ssize_t _read_in_order(
    const uint64_t* pk, Py_ssize_t n, uint64_t mask, const int64_t* ids, uint64_t flip,
    int64_t* u, int64_t* inv
) noexcept nogil:
    """The ``n`` (at least 1) ids at the positions ``pk`` holds (its words' low bits), in
    that order, into ``u`` (each distinct id once) and ``inv`` (each id's place in ``u``):
    how many went into ``u``, or -1 if an id came after a greater one."""
    cdef Py_ssize_t t, i = <Py_ssize_t>(pk[0] & mask), m = 0
    cdef int64_t v, prev = ids[i]
    cdef bint back = False
    u[0] = prev
    inv[i] = 0
    for t in range(1, n):
        i = <Py_ssize_t>(pk[t] & mask)
        v = ids[i]
        back |= (<uint64_t>v ^ flip) < (<uint64_t>prev ^ flip)
        m += v != prev
        u[m] = v
        inv[i] = m
        prev = v
    return -1 if back else m + 1


cdef bint _order_run(
    uint64_t* pk, Py_ssize_t a, Py_ssize_t b, uint64_t mask, const int64_t* ids, uint64_t flip
) noexcept nogil:
    """``pk[a:b]`` (words whose kept bits tie, so in the order of their positions) in the
    order of their ids, equal ids keeping theirs: left as it is if it already is, else by
    insertion up to ``INSERTION_RUN`` long; False (nothing changed) if longer."""
    cdef Py_ssize_t j, t
    cdef uint64_t word, key
    for j in range(a + 1, b):
        if (<uint64_t>ids[pk[j - 1] & mask] ^ flip) > (<uint64_t>ids[pk[j] & mask] ^ flip):
            break
    else:
        return True
    if b - a > INSERTION_RUN:
        return False
    for j in range(a + 1, b):
        word = pk[j]
        key = <uint64_t>ids[word & mask] ^ flip
        t = j
        while t > a and (<uint64_t>ids[pk[t - 1] & mask] ^ flip) > key:
            pk[t] = pk[t - 1]
            t -= 1
        pk[t] = word
    return True


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
