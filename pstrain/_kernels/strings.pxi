# Included by compiled.pyx: string hashes. FarmHash's Fingerprint64 (farmhashna::Hash64), as
# TF's to_hash_bucket_fast, and SipHash-2-4, as its to_hash_bucket_strong.
#
# Written from the published algorithm; tests hold it to TensorFlow's own fingerprints and to
# the pure-Python version in reference/strings.py.
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
