# Included by compiled.pyx: TFRecord files and tf.Example protos. CRC32C (slice by 8), a
# buffer's records split and checked, and the features of Example records parsed into arrays.

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
