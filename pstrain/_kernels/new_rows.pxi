# Included by compiled.pyx: a dynamic table's new rows, their initial values from each id's
# hash (as the reference's formula) and their bookkeeping, in one pass.

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


def initial_rows(const int64_t[::1] ids, uint64_t seed, uint64_t golden, uint64_t salt, double low,
                 double high, real[:, ::1] out):
    """Each of ``ids``' initial row into ``out`` (one row an id), as :func:`create_rows`
    writes it, bit for bit; nothing else written."""
    cdef Py_ssize_t i, j, n = ids.shape[0], dim = out.shape[1]
    cdef uint64_t x
    cdef double span = high - low
    if out.shape[0] != n:
        raise ValueError(f"initial_rows: out has {out.shape[0]} rows for {n} ids")
    cdef uint64_t[::1] col = _columns(dim, seed, salt)
    with nogil:
        for i in range(n):
            x = <uint64_t>ids[i] * golden
            for j in range(dim):
                out[i, j] = <real>(low + span * _unit(x, col[j]))


def as_created(const int64_t[::1] rows, const int64_t[::1] ids, const real[:, ::1] values,
               tuple slots, tuple inits, const int64_t[::1] freq, uint64_t seed, uint64_t golden,
               uint64_t salt, double low, double high, uint8_t[::1] out):
    """``out[i]``: 1 where row ``rows[i]`` (id ``ids[i]``) holds what :func:`create_rows`
    made it, bit for bit: its initial values, each slot (``slots``, shaped as ``values``)
    at its initial value (``inits``) and a count (``freq``) of 0; else 0. A row is left at
    its first difference (a trained row's first column, nearly always), so the rows of a
    table in training cost a hash each. A row outside the arrays is refused first."""
    cdef Py_ssize_t i, j, k, r, n = rows.shape[0], dim = values.shape[1], ns = len(slots)
    cdef Py_ssize_t limit = min(values.shape[0], freq.shape[0])
    cdef uint64_t x
    cdef double span = high - low
    cdef real v
    cdef bint same
    cdef const real[:, ::1] view
    if ids.shape[0] != n or out.shape[0] != n or len(inits) != ns:
        raise ValueError(f"as_created: {n} rows for {ids.shape[0]} ids and {out.shape[0]} answers, "
                         f"{ns} slots for {len(inits)} initial values")
    for i in range(n):
        if not 0 <= rows[i] < limit:
            raise IndexError("as_created: a row outside the table")
    if n == 0:
        return
    addresses, initial = np.empty(ns, np.uintp), np.asarray(inits, np.float64)
    cdef uintptr_t[::1] slot_rows = addresses
    cdef const double[::1] slot_init = initial
    for k in range(ns):
        view = slots[k]
        if view.shape[0] != values.shape[0] or view.shape[1] != dim:
            raise ValueError("as_created: a slot not shaped as the rows")
        slot_rows[k] = <uintptr_t>&view[0, 0]
    cdef uint64_t[::1] col = _columns(dim, seed, salt)
    with nogil:
        for i in range(n):
            r = rows[i]
            same = freq[r] == 0
            x = <uint64_t>ids[i] * golden
            j = 0
            while same and j < dim:
                v = <real>(low + span * _unit(x, col[j]))
                same = memcmp(&values[r, j], &v, sizeof(real)) == 0
                j += 1
            k = 0
            while same and k < ns:
                v = <real>slot_init[k]
                j = 0
                while same and j < dim:
                    same = memcmp(<const real*>slot_rows[k] + r * dim + j, &v, sizeof(real)) == 0
                    j += 1
                k += 1
            out[i] = same
