# Included by compiled.pyx: pooled bags and a dataset's batches. Pooling a batch's bags (and
# its backward), the positions and values of the bags a batch takes, a shuffle buffer's
# draws, and fixed-width examples taken by row.

#: Ids ahead whose row a pooled lookup (or its backward) asks for: a row is a cache line or
#: two of a batch's distinct rows, read in the order the bags name them.
DEF POOL_AHEAD = 16
#: Bags (or examples) ahead whose memory a dataset's batch asks for: a bag is a few ids,
#: two cache misses (its offsets, then its values) that more bags in flight hide.
DEF BAG_AHEAD = 24
#: A dataset's batch copies a bag of up to this many bytes as this many, whatever its length
#: (a bag of a few ids: one copy the compiler unrolls, where a loop of its length mispredicts).
DEF SHORT_BAG = 32


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


def take_keyed_bags(
    const uint8_t[::1] values,
    Py_ssize_t itemsize,
    const int64_t[::1] offsets,
    const int32_t[:, ::1] lengths,
    const int64_t[::1] rows,
    int64_t[:, ::1] out_offsets,
    int64_t[::1] out_starts,
):
    """Examples ``rows`` of many features kept example by example (``values``: the bytes of
    every example's bags side by side, feature after feature, example ``r``'s from item
    ``offsets[r]``; ``lengths[r, f]``: its bag of feature ``f``), feature by feature:
    returns an array holding each feature's ids for ``rows`` end to end, feature ``f``'s
    from item ``out_starts[f]``, with its bags' offsets (from 0) in its row of
    ``out_offsets`` (``(features, rows + 1)``). An example's bags are one run of memory,
    asked for :data:`BAG_AHEAD` examples before: a batch drawn at random waits on a cache
    miss or two an example, not two a bag of each feature. A bag of up to
    :data:`SHORT_BAG` bytes is copied as that many (one branch-free copy, not a loop of its
    length): each feature's ids are followed by that many bytes of room."""
    cdef Py_ssize_t i, f, r, n = rows.shape[0], examples = offsets.shape[0] - 1
    cdef Py_ssize_t features = lengths.shape[1], total = 0, size, at, room, dst, end = values.shape[0]
    cdef int64_t run
    cdef bint bad = False, bad_lengths = False
    if out_offsets.shape[0] != features or out_offsets.shape[1] != n + 1 or out_starts.shape[0] != features:
        raise ValueError("take_keyed_bags: out_offsets is not (features, rows + 1), or out_starts "
                         "not one a feature")
    if itemsize <= 0 or values.shape[0] % itemsize or lengths.shape[0] != examples:
        raise ValueError("take_keyed_bags: values are not a whole number of items, or the "
                         "lengths are not one row an example")
    room = (SHORT_BAG + itemsize - 1) // itemsize  # items after each feature's
    with nogil:
        for f in range(features):
            out_offsets[f, 0] = 0
        for i in range(n):
            if i + BAG_AHEAD < n and 0 <= rows[i + BAG_AHEAD] < examples:
                __builtin_prefetch(&offsets[rows[i + BAG_AHEAD]])
                __builtin_prefetch(&lengths[rows[i + BAG_AHEAD], 0])
            r = rows[i]
            if r < 0 or r >= examples:
                bad = True
                break
            run = 0
            for f in range(features):
                if lengths[r, f] < 0:
                    bad_lengths = True
                run += lengths[r, f]
                out_offsets[f, i + 1] = out_offsets[f, i] + lengths[r, f]
            if bad_lengths or offsets[r] < 0 or offsets[r + 1] - offsets[r] != run \
                    or offsets[r + 1] * itemsize > end:
                bad_lengths = True
                break
        if not bad and not bad_lengths:
            for f in range(features):
                out_starts[f] = total
                total += out_offsets[f, n] + room
    if bad:
        raise IndexError("take_keyed_bags: an example outside the batch")
    if bad_lengths:
        raise IndexError("take_keyed_bags: an example's lengths do not match its offsets")
    out = np.empty(total * itemsize, np.uint8)
    cdef uint8_t[::1] o = out
    if n == 0:
        return out
    with nogil:
        for i in range(n):
            if i + BAG_AHEAD < n:
                r = rows[i + BAG_AHEAD]
                _prefetch(<const char*>&values[0] + offsets[r] * itemsize, (offsets[r + 1] - offsets[r]) * itemsize)
            r = rows[i]
            at = offsets[r] * itemsize
            for f in range(features):
                size = lengths[r, f] * itemsize
                dst = (out_starts[f] + out_offsets[f, i]) * itemsize
                if size <= SHORT_BAG and at + SHORT_BAG <= end:
                    memcpy(&o[dst], &values[at], SHORT_BAG)  # (the room after takes the rest)
                elif size:
                    _copy_items(&o[dst], &values[at], lengths[r, f], itemsize)
                at += size
    return out


def interleave_bags(
    const uint8_t[::1] values, Py_ssize_t itemsize, const int64_t[::1] offsets,
    uint8_t[::1] out, int64_t[::1] cursor,
):
    """One feature's bags (``values``: their bytes, bag ``b`` from item ``offsets[b]``) into
    ``out``, an array of every example's bags side by side: bag ``b`` at item ``cursor[b]``,
    which moves past it (the next feature's bag of that example goes there). The layout
    :func:`take_keyed_bags` takes batches from, made a feature at a time."""
    cdef Py_ssize_t b, n = offsets.shape[0] - 1, size
    cdef bint bad = False
    if cursor.shape[0] != n or itemsize <= 0 or values.shape[0] % itemsize or out.shape[0] % itemsize:
        raise ValueError("interleave_bags: cursor is not one an example, or values or out are "
                         "not a whole number of items")
    with nogil:
        for b in range(n):
            size = offsets[b + 1] - offsets[b]
            if size < 0 or offsets[b] < 0 or offsets[b + 1] * itemsize > values.shape[0] \
                    or cursor[b] < 0 or (cursor[b] + size) * itemsize > out.shape[0]:
                bad = True
                break
        if not bad:
            for b in range(n):
                size = offsets[b + 1] - offsets[b]
                if size:
                    _copy_items(&out[cursor[b] * itemsize], &values[offsets[b] * itemsize], size, itemsize)
                    cursor[b] += size
    if bad:
        raise IndexError("interleave_bags: a bag outside its values or out")


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
