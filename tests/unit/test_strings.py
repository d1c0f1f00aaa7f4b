"""``pstrain.strings`` against TensorFlow's own numbers: ``tf.fingerprint(..., "farmhash64")``,
``tf.strings.to_hash_bucket_fast`` and ``to_hash_bucket_strong`` (four keys) of strings of
every length to 300 (each branch of FarmHash, each tail of SipHash), ASCII and not
(``references/make_references.py tf_strings``); the compiled kernels against the Python ones
on random bytes; and the input forms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pstrain
from pstrain._kernels import compiled, reference
from pstrain.errors import InvalidArgumentError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TF = json.loads((Path(__file__).resolve().parent / "references" / "tf_strings.json").read_text())


def test_fingerprints_and_buckets_are_tensorflows():
    got = pstrain.strings.fingerprint64(TF["strings"])
    assert got.dtype == np.uint64 and [str(int(x)) for x in got] == TF["fingerprint64"]
    for k, buckets in TF["buckets"].items():
        assert pstrain.strings.to_hash_bucket_fast(TF["strings"], int(k)).tolist() == buckets


def test_strong_buckets_are_tensorflows_for_every_key():
    for key, by_count in TF["strong_buckets"].items():
        k0, k1 = (int(k) for k in key.split(","))
        for n, buckets in by_count.items():
            got = pstrain.strings.to_hash_bucket_strong(TF["strings"], int(n), [k0, k1])
            assert got.tolist() == buckets, (key, n)
    # Keras' Hashing(salt=133) is the key [133, 133]; a key as numpy integers, or past 2**63
    # (TF takes each as 64 bits), hashes the same
    assert (
        pstrain.strings.to_hash_bucket_strong("bob", 7, np.array([133, 133]))
        == TF["strong_buckets"]["133,133"]["7"][TF["strings"].index("bob")]
    )
    assert pstrain.strings.to_hash_bucket_strong(["a"], 1000003, [-1, 5]).tolist() == (
        pstrain.strings.to_hash_bucket_strong(["a"], 1000003, [2**64 - 1, 5]).tolist()
    )


def test_the_compiled_hash_is_the_python_one_on_random_bytes():
    rng = np.random.default_rng(3)
    strings = [bytes(rng.integers(0, 256, n).astype(np.uint8)) for n in [*range(0, 200), 255, 256, 257, 1000]]
    data = np.frombuffer(b"".join(strings), np.uint8).copy()
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in strings])]).astype(np.int64)
    np.testing.assert_array_equal(
        compiled.fingerprint64(data, offsets), reference.fingerprint64(data, offsets)
    )
    for k0, k1 in ((0, 0), (2**64 - 1, 7), (0x0706050403020100, 0x0F0E0D0C0B0A0908)):
        np.testing.assert_array_equal(
            compiled.siphash24(data, offsets, k0, k1), reference.siphash24(data, offsets, k0, k1)
        )
    for kernels in (compiled, reference):
        with pytest.raises(ValueError, match="offsets outside the data or decreasing"):
            kernels.fingerprint64(data, np.array([0, 5, 3], np.int64))
        with pytest.raises(ValueError, match="offsets outside the data or decreasing"):
            kernels.siphash24(data, np.array([0, 5, 3], np.int64), 1, 2)


def test_siphash_gives_the_papers_test_vector():
    """SipHash-2-4's reference vector (Aumasson and Bernstein, appendix A): key 00..0f, message
    00..0e, hash a129ca6149be45e5."""
    data = np.arange(15, dtype=np.uint8)
    got = compiled.siphash24(data, np.array([0, 15], np.int64), 0x0706050403020100, 0x0F0E0D0C0B0A0908)
    assert int(got[0]) == 0xA129CA6149BE45E5


def test_inputs_of_any_shape_and_kind_and_refusals():
    grid = np.array([["alice", "bob"], ["hello", ""]])
    buckets = pstrain.strings.to_hash_bucket_fast(grid, 1000003)
    assert buckets.shape == (2, 2) and buckets.dtype == np.int64
    index = {s: b for s, b in zip(TF["strings"], TF["buckets"]["1000003"])}
    assert buckets.tolist() == [[index["alice"], index["bob"]], [index["hello"], index[""]]]
    assert pstrain.strings.to_hash_bucket_fast("alice", 1000003) == index["alice"]  # a scalar
    assert pstrain.strings.to_hash_bucket_fast(b"alice", 1000003) == index["alice"]  # bytes as they are
    assert pstrain.strings.fingerprint64([]).shape == (0,)
    ids = pstrain.strings.fingerprint64(["a", "b"]).view(np.int64)  # ids for a DynamicEmbedding
    assert ids.dtype == np.int64
    for bad, message in (
        (
            lambda: pstrain.strings.to_hash_bucket_fast(["a"], 0),
            "num_buckets must be an integer of 1 or more",
        ),
        (
            lambda: pstrain.strings.to_hash_bucket_fast(np.arange(3), 5),
            "takes strings, got an array of int64",
        ),
        (lambda: pstrain.strings.fingerprint64(["a", 3]), "must be str or bytes, got int"),
        (lambda: pstrain.strings.to_hash_bucket_strong(["a"], 5, [1]), "key must be two 64-bit integers"),
        (lambda: pstrain.strings.to_hash_bucket_strong(["a"], 5, 133), "key must be two 64-bit integers"),
        (lambda: pstrain.strings.to_hash_bucket_strong(["a"], 5, [1.5, 2]), "key must be two 64-bit"),
        (lambda: pstrain.strings.to_hash_bucket_strong(["a"], 5, [2**64, 2]), "key must be two 64-bit"),
        (lambda: pstrain.strings.to_hash_bucket_strong(["a"], 0, [1, 2]), "num_buckets must be"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            bad()


def test_numpy_string_arrays_hash_as_tensorflows_strings():
    """A numpy array of ``str`` (``U``) or ``bytes`` (``S``), hashed without Python per
    string when it can be, gives TF's fingerprints of the same strings."""
    strings = TF["strings"]
    want = [str(int(x)) for x in pstrain.strings.fingerprint64(np.array(strings, object))]
    assert want == TF["fingerprint64"]
    as_str = np.array(strings)  # (ASCII and not: the others go string by string)
    assert [str(int(x)) for x in pstrain.strings.fingerprint64(as_str)] == TF["fingerprint64"]
    ascii_only = [s for s in strings if s.isascii()]
    expected = [f for s, f in zip(strings, TF["fingerprint64"]) if s.isascii()]
    for arr in (np.array(ascii_only), np.array([s.encode() for s in strings])):
        keep = expected if arr.dtype.kind == "U" else TF["fingerprint64"]
        assert [str(int(x)) for x in pstrain.strings.fingerprint64(arr)] == keep
    grid = np.array([["ab", ""], ["c", "dddd"]])
    assert pstrain.strings.to_hash_bucket_fast(grid, 7).tolist() == [
        pstrain.strings.to_hash_bucket_fast(list(row), 7).tolist() for row in grid.tolist()
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=1, max_size=20), st.booleans())
def test_any_numpy_string_array_hashes_as_its_strings_one_by_one(strings, as_bytes):
    """numpy drops a string's trailing NULs when it reads one out of an array: the whole-
    array path hashes the same strings as the one-by-one path does."""
    arr = np.array([s.encode() for s in strings]) if as_bytes else np.array(strings)
    one_by_one = np.array(arr.tolist(), object)
    assert pstrain.strings.fingerprint64(arr).tolist() == pstrain.strings.fingerprint64(one_by_one).tolist()
