"""Keras' ``StringLookup`` and ``IntegerLookup`` as ``pstrain.data``'s: the indices (or
tokens, inverted), the vocabulary and its size, or the refusal, of the cases Keras 3 ran
(``references/make_references.py keras_lookups``); and what pstrain adds: ``bytes`` inputs
(what file datasets give), a vocabulary file, adapting to batches. Keras' ``Hashing`` and
``HashedCrossing``: the bins Keras 3 gave (``keras_hashing``); ``Discretization``: the
buckets of given boundaries, and the boundaries ``adapt`` finds (``keras_discretization``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain.data import Discretization, HashedCrossing, Hashing, IntegerLookup, StringLookup
from pstrain.errors import InvalidArgumentError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

HERE = Path(__file__).resolve().parent / "references"
REFERENCE = json.loads((HERE / "keras_lookups.json").read_text())
HASHING = json.loads((HERE / "keras_hashing.json").read_text())
BUCKETS = json.loads((HERE / "keras_discretization.json").read_text())


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"{c['layer']}-{c['kwargs']}")
def test_lookups_give_keras_indices_tokens_and_vocabularies(case):
    make = StringLookup if case["layer"] == "string" else IntegerLookup

    def run():
        if "adapt" in case:
            layer = make(**case["kwargs"])
            layer.adapt(np.array(case["adapt"]))
        else:
            layer = make(vocabulary=case["vocabulary"], **case["kwargs"])
        return layer, layer(np.array(case["inputs"]))

    if case["error"]:
        with pytest.raises(InvalidArgumentError):  # (a ValueError, as Keras' refusals)
            run()
        return
    layer, got = run()
    assert got.tolist() == case["output"]
    assert layer.get_vocabulary() == case["vocabulary_out"]
    assert layer.vocabulary_size() == case["vocabulary_size"]


def test_bytes_inputs_a_vocabulary_file_and_adapting_to_batches(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("avenger\nironman\nbatman\n")
    layer = StringLookup(vocabulary=str(vocab))
    assert layer(np.array([b"batman", b"hulk", "avenger"], object)).tolist() == [3, 0, 1]
    assert layer(np.array([["ironman"]])).dtype == np.int64
    # a dataset's batches, as TF's tutorial adapts its lookups
    batches = pstrain.data.Dataset.from_tensor_slices(np.array(["b", "a", "b", "c", "b", "a"])).batch(4)
    adapted = StringLookup(max_tokens=3)
    adapted.adapt(batches.as_numpy_iterator())
    assert adapted.get_vocabulary() == ["[UNK]", "b", "a"]
    inverse = StringLookup(vocabulary=["a", "b"], invert=True)
    assert inverse(np.array([[2, 0], [1, 5]])).tolist() == [["b", "[UNK]"], ["a", "[UNK]"]]
    with pytest.raises(InvalidArgumentError, match="output_mode 'one_hot' is not supported"):
        StringLookup(vocabulary=["a"], output_mode="one_hot")
    with pytest.raises(InvalidArgumentError, match="takes integers"):
        IntegerLookup(vocabulary=[1, 2])(np.array(["x"]))
    with pytest.raises(InvalidArgumentError, match="'q' is not"):
        StringLookup(vocabulary=["a"], num_oov_indices=0)(np.array(["q", "a"]))


def _array(values: list) -> np.ndarray:
    return np.array(values, object) if isinstance(values[0], str) else np.array(values, np.int64)


def test_integer_lookup_reads_ids_in_either_byte_order_alike():
    """Big-endian ids are the same ids: int64 and uint64 (one past 2**63 is not the
    negative int64 of the same bits, so not the vocabulary's -3)."""
    layer = IntegerLookup(vocabulary=[-3, 7])
    signed = np.array([-3, 7, 4], np.int64)
    assert layer(signed.astype(">i8")).tolist() == layer(signed).tolist() == [1, 2, 0]
    unsigned = np.array([2**64 - 3, 7, 4], np.uint64)
    assert layer(unsigned.astype(">u8")).tolist() == layer(unsigned).tolist() == [0, 2, 0]


def test_hashing_and_crossing_give_keras_bins():
    for case in HASHING["hashing"]:  # strings (with a mask, with salts) and integers
        assert Hashing(**case["kwargs"])(_array(case["inputs"])).tolist() == case["output"], case["kwargs"]
    for case in HASHING["crossing"]:  # pairs and a triple, strings and integers
        features = [_array(f) for f in case["features"]]
        assert HashedCrossing(case["num_bins"])(features).tolist() == case["output"], case["num_bins"]
        column = HashedCrossing(case["num_bins"])([f.reshape(-1, 1) for f in features])
        assert column.tolist() == [[v] for v in case["output"]]  # (batch, 1) in, (batch, 1) out
    assert len(HASHING["hashing"]) == 7 and len(HASHING["crossing"]) == 4
    one = HashedCrossing(97)([np.array("a"), np.array(3)])
    assert one.shape == () and int(one) == HashedCrossing(97)([np.array(["a"]), np.array([3])])[0]
    with pytest.raises(InvalidArgumentError, match="two features or more"):
        HashedCrossing(5)([np.array(["a"])])
    with pytest.raises(InvalidArgumentError, match="different shapes"):
        HashedCrossing(5)([np.array(["a", "b"]), np.array([1])])
    with pytest.raises(InvalidArgumentError, match="num_bins must be a positive integer"):
        Hashing(0)


def test_discretization_gives_keras_buckets_and_adapts_to_keras_boundaries():
    for case in BUCKETS["cases"]:
        inputs = np.array(case["inputs"], np.float32)
        if "boundaries" in case:  # values on a boundary among them
            assert Discretization(bin_boundaries=case["boundaries"])(inputs).tolist() == case["output"]
            continue
        layer = Discretization(num_bins=case["num_bins"], epsilon=case["epsilon"])
        batches = [np.array(a, np.float32) for a in case["adapt"]]
        layer.adapt(batches[0] if len(batches) == 1 else iter(batches))  # one array, or batches
        assert layer.bin_boundaries == case["boundaries_out"]  # bit for bit
        assert layer(inputs).tolist() == case["output"]
    assert len(BUCKETS["cases"]) == 8
    with pytest.raises(InvalidArgumentError, match="bin_boundaries or num_bins"):
        Discretization()
    with pytest.raises(InvalidArgumentError, match="cannot adapt"):
        Discretization(bin_boundaries=[0.0]).adapt(np.zeros(3))


def test_vocabulary_files_are_read_as_keras_reads_them(tmp_path):
    """Keras reads a vocabulary file through TF's ``TextFileInitializer``: a line each,
    without its ``\\n`` and one ``\\r``; an empty line refused (pstrain skipped it); the
    file's tokens as they are, a first ``[UNK]`` or ``-1`` a token too (pstrain took them
    for the special tokens and shifted every index); integers as TF reads them (``1_0``
    refused, which Python's ``int`` takes). Indices read off Keras 3 with TF 2.21."""
    path = tmp_path / "vocabulary.txt"

    def lookup(layer, data, probe):
        path.write_bytes(data)
        return [int(i) for i in np.asarray(layer(vocabulary=str(path))(np.array(probe))).tolist()]

    assert lookup(StringLookup, b"[UNK]\na\nb\n", ["[UNK]", "a", "b", "z", ""]) == [1, 2, 3, 0, 0]
    assert lookup(StringLookup, b"a\r\nb", ["a", "b", "a\r"]) == [1, 2, 0]
    assert lookup(IntegerLookup, b"-1\n2", [1, 2, -1]) == [0, 2, 1]
    assert lookup(IntegerLookup, b" 3\n+4\n7 ", [3, 4, 7, 5]) == [1, 2, 3, 0]
    for layer, data in ((StringLookup, b"a\n\nb"), (StringLookup, b"\na"), (IntegerLookup, b"1\n\n2")):
        path.write_bytes(data)
        with pytest.raises(InvalidArgumentError, match="line 2 is empty|line 1 is empty"):
            layer(vocabulary=str(path))
    for data in (b"1_0\n2", b"0x10"):
        path.write_bytes(data)
        with pytest.raises(InvalidArgumentError, match="line 1 is not an integer"):
            IntegerLookup(vocabulary=str(path))
