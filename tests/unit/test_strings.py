"""``pstrain.strings`` against TensorFlow's own numbers: ``tf.fingerprint(..., "farmhash64")``
and ``tf.strings.to_hash_bucket_fast`` of strings of every length to 300 (each branch of
FarmHash), ASCII and not (``references/make_references.py tf_strings``); the compiled kernel
against the Python one on random bytes; and the input forms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

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


def test_the_compiled_hash_is_the_python_one_on_random_bytes():
    rng = np.random.default_rng(3)
    strings = [bytes(rng.integers(0, 256, n).astype(np.uint8)) for n in [*range(0, 200), 255, 256, 257, 1000]]
    data = np.frombuffer(b"".join(strings), np.uint8).copy()
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in strings])]).astype(np.int64)
    np.testing.assert_array_equal(
        compiled.fingerprint64(data, offsets), reference.fingerprint64(data, offsets)
    )
    for kernels in (compiled, reference):
        with pytest.raises(ValueError, match="offsets outside the data or decreasing"):
            kernels.fingerprint64(data, np.array([0, 5, 3], np.int64))


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
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            bad()
