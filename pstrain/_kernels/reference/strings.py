"""String hashes in Python integers: FarmHash's Fingerprint64 (farmhashna::Hash64) and
SipHash-2-4."""

from __future__ import annotations

import numpy as np

__all__ = ["fingerprint64", "siphash24"]

# FarmHash's Fingerprint64 (farmhashna::Hash64)
_M64 = (1 << 64) - 1
_FH_K0, _FH_K1, _FH_K2 = 0xC3A5C85C97CB3127, 0xB492B66FBE98F273, 0x9AE16A3B2F90404F


def _fh_rot(v: int, s: int) -> int:
    return v if s == 0 else ((v >> s) | (v << (64 - s))) & _M64


def _fh_h16(u: int, v: int, mul: int) -> int:
    a = ((u ^ v) * mul) & _M64
    a ^= a >> 47
    b = ((v ^ a) * mul) & _M64
    b ^= b >> 47
    return (b * mul) & _M64


def _fh_weak32(s: bytes, i: int, a: int, b: int) -> tuple[int, int]:
    w, x, y, z = (int.from_bytes(s[j : j + 8], "little") for j in range(i, i + 32, 8))
    a = (a + w) & _M64
    b = _fh_rot((b + a + z) & _M64, 21)
    c = a
    a = (a + x + y) & _M64
    b = (b + _fh_rot(a, 44)) & _M64
    return (a + z) & _M64, (b + c) & _M64


def _fingerprint(s: bytes) -> int:
    n, k0, k1, k2, m = len(s), _FH_K0, _FH_K1, _FH_K2, _M64

    def f64(i: int) -> int:
        return int.from_bytes(s[i : i + 8], "little")

    def f32(i: int) -> int:
        return int.from_bytes(s[i : i + 4], "little")

    mul = (k2 + n * 2) & m
    if n <= 16:
        if n >= 8:
            a, b = (f64(0) + k2) & m, f64(n - 8)
            return _fh_h16((_fh_rot(b, 37) * mul + a) & m, ((_fh_rot(a, 25) + b) * mul) & m, mul)
        if n >= 4:
            return _fh_h16((n + (f32(0) << 3)) & m, f32(n - 4), mul)
        if n > 0:
            y, z = s[0] + (s[n >> 1] << 8), n + (s[n - 1] << 2)
            v = ((y * k2) ^ (z * k0)) & m
            return ((v ^ (v >> 47)) * k2) & m
        return k2
    a, b, c, d = (
        (f64(0) * (k1 if n <= 32 else k2)) & m,
        f64(8),
        (f64(n - 8) * mul) & m,
        (f64(n - 16) * k2) & m,
    )
    y = (_fh_rot((a + b) & m, 43) + _fh_rot(c, 30) + d) & m
    if n <= 32:
        return _fh_h16(y, (a + _fh_rot((b + k2) & m, 18) + c) & m, mul)
    if n <= 64:
        z = _fh_h16(y, (a + _fh_rot((b + k2) & m, 18) + c) & m, mul)
        e, f = (f64(16) * mul) & m, f64(24)
        g, h = ((y + f64(n - 32)) * mul) & m, ((z + f64(n - 24)) * mul) & m
        return _fh_h16(
            (_fh_rot((e + f) & m, 43) + _fh_rot(g, 30) + h) & m, (e + _fh_rot((f + a) & m, 18) + g) & m, mul
        )
    x, y = 81, (81 * k1 + 113) & m
    z = (((y * k2 + 113) & m) ^ (((y * k2 + 113) & m) >> 47)) * k2 & m
    v0 = v1 = w0 = w1 = 0
    x = (x * k2 + f64(0)) & m
    end, i = ((n - 1) // 64) * 64, 0
    while True:
        x = (_fh_rot((x + y + v0 + f64(i + 8)) & m, 37) * k1) & m
        y = (_fh_rot((y + v1 + f64(i + 48)) & m, 42) * k1) & m
        x ^= w1
        y = (y + v0 + f64(i + 40)) & m
        z = (_fh_rot((z + w0) & m, 33) * k1) & m
        v0, v1 = _fh_weak32(s, i, (v1 * k1) & m, (x + w0) & m)
        w0, w1 = _fh_weak32(s, i + 32, (z + w1) & m, (y + f64(i + 16)) & m)
        z, x = x, z
        i += 64
        if i == end:
            break
    mul = (k1 + ((z & 0xFF) << 1)) & m
    i = end + ((n - 1) & 63) - 63
    w0 = (w0 + ((n - 1) & 63)) & m
    v0 = (v0 + w0) & m
    w0 = (w0 + v0) & m
    x = (_fh_rot((x + y + v0 + f64(i + 8)) & m, 37) * mul) & m
    y = (_fh_rot((y + v1 + f64(i + 48)) & m, 42) * mul) & m
    x ^= (w1 * 9) & m
    y = (y + v0 * 9 + f64(i + 40)) & m
    z = (_fh_rot((z + w0) & m, 33) * mul) & m
    v0, v1 = _fh_weak32(s, i, (v1 * mul) & m, (x + w0) & m)
    w0, w1 = _fh_weak32(s, i + 32, (z + w1) & m, (y + f64(i + 16)) & m)
    z, x = x, z
    return _fh_h16((_fh_h16(v0, w0, mul) + (y ^ (y >> 47)) * k0 + z) & m, (_fh_h16(v1, w1, mul) + x) & m, mul)


def _strings_checked(data: np.ndarray, offsets: np.ndarray, what: str) -> int:
    n = offsets.shape[0] - 1
    if n < 0:
        raise ValueError(f"{what}: offsets must hold at least one number")
    if n and (int(offsets[0]) < 0 or np.any(np.diff(offsets) < 0) or int(offsets[-1]) > data.shape[0]):
        raise ValueError(f"{what}: offsets outside the data or decreasing")
    return n


def fingerprint64(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    n = _strings_checked(data, offsets, "fingerprint64")
    raw = data.tobytes()
    return np.array([_fingerprint(raw[offsets[i] : offsets[i + 1]]) for i in range(n)], np.uint64)


def _sipround(v: list[int]) -> None:
    v[0] = (v[0] + v[1]) & _M64
    v[1] = _rotl64(v[1], 13) ^ v[0]
    v[0] = _rotl64(v[0], 32)
    v[2] = (v[2] + v[3]) & _M64
    v[3] = _rotl64(v[3], 16) ^ v[2]
    v[0] = (v[0] + v[3]) & _M64
    v[3] = _rotl64(v[3], 21) ^ v[0]
    v[2] = (v[2] + v[1]) & _M64
    v[1] = _rotl64(v[1], 17) ^ v[2]
    v[2] = _rotl64(v[2], 32)


def _rotl64(v: int, s: int) -> int:
    return ((v << s) | (v >> (64 - s))) & _M64


def _siphash(raw: bytes, k0: int, k1: int) -> int:
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    whole = len(raw) - len(raw) % 8
    for i in range(0, whole, 8):
        m = int.from_bytes(raw[i : i + 8], "little")
        v[3] ^= m
        _sipround(v)
        _sipround(v)
        v[0] ^= m
    last = ((len(raw) & 0xFF) << 56) | int.from_bytes(raw[whole:], "little")
    v[3] ^= last
    _sipround(v)
    _sipround(v)
    v[0] ^= last
    v[2] ^= 0xFF
    for _ in range(4):
        _sipround(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def siphash24(data: np.ndarray, offsets: np.ndarray, k0: int, k1: int) -> np.ndarray:
    n = _strings_checked(data, offsets, "siphash24")
    raw = data.tobytes()
    return np.array(
        [_siphash(raw[offsets[i] : offsets[i + 1]], int(k0), int(k1)) for i in range(n)], np.uint64
    )
