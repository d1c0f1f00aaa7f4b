"""``pstrain.data.TFRecordDataset`` reads the files TensorFlow's ``TFRecordWriter`` wrote
(plain, GZIP, ZLIB; ``references/make_references.py tf_records``) record for record, NUL
bytes and all; a damaged or cut file is a ``DataLossError`` naming where, as TF reports it;
the CRC-32C kernel against its Python twin and the standard check value."""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain._kernels import compiled, reference
from pstrain.data import Dataset, TFRecordDataset, TFRecordWriter
from pstrain.errors import DataLossError, InvalidArgumentError, NotFoundError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TF = json.loads((Path(__file__).resolve().parent / "references" / "tf_records.json").read_text())
RECORDS = [base64.b64decode(r) for r in TF["records"]]


@pytest.fixture
def files(tmp_path):
    out = {}
    for compression, data in TF["files"].items():
        path = tmp_path / f"records{compression}.tfrecord"
        path.write_bytes(base64.b64decode(data))
        out[compression or None] = path
    return out


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
@pytest.mark.parametrize("buffer_size", [None, 5])
def test_the_records_tensorflow_wrote_are_read_back_whole(files, compression, buffer_size):
    got = list(TFRecordDataset(str(files[compression]), compression, buffer_size=buffer_size))
    assert got == RECORDS and all(type(r) is bytes for r in got)  # trailing NULs kept


def test_files_side_by_side_and_batches_keep_every_byte(files):
    path = str(files[None])
    both = list(TFRecordDataset([path, path], num_parallel_reads=2))
    assert both == [r for r in RECORDS for _ in range(2)]  # TF's order: a record of each in turn
    batch = next(iter(TFRecordDataset(Dataset.from_tensor_slices([path])).batch(3)))
    assert batch.dtype == object and batch.tolist() == RECORDS[:3]
    assert batch[2].endswith(b"\x00\x00")


def test_damage_is_a_data_loss_naming_the_record(files, tmp_path):
    raw = files[None].read_bytes()
    second = 12 + len(RECORDS[0]) + 4  # where the second record starts
    for offset, message in (
        (second + 3, f"corrupted record at {second} .its length's checksum"),
        (second + 12 + 1, f"corrupted record at {second} .its data's checksum"),
    ):
        bad = bytearray(raw)
        bad[offset] ^= 1
        path = tmp_path / "bad.tfrecord"
        path.write_bytes(bytes(bad))
        with pytest.raises(DataLossError, match=message):
            list(TFRecordDataset(str(path)))
    cut = tmp_path / "cut.tfrecord"
    cut.write_bytes(raw[: second + 12 + 2])  # inside the second record's data
    with pytest.raises(DataLossError, match=f"truncated record at {second}"):
        list(TFRecordDataset(str(cut)))
    cut.write_bytes(raw[: second + 5])  # inside its header: the end, as in TF
    assert list(TFRecordDataset(str(cut))) == RECORDS[:1]
    with pytest.raises(NotFoundError, match="nope.tfrecord: no such file"):
        list(TFRecordDataset(str(tmp_path / "nope.tfrecord")))
    with pytest.raises(DataLossError, match="is not whole GZIP data"):  # (TF's error, too)
        list(TFRecordDataset(str(files[None]), "GZIP"))
    # a damaged GZIP file gives the records before the damage, then the error, as TF's
    packed = gzip.compress(raw)
    got = []
    damaged = tmp_path / "damaged.gz"
    damaged.write_bytes(packed + b"not gzip at all")
    with pytest.raises(DataLossError, match="damaged.gz is not whole GZIP data"):
        got.extend(TFRecordDataset(str(damaged), "GZIP"))
    assert got == RECORDS
    with pytest.raises(InvalidArgumentError, match="compression_type must be"):
        TFRecordDataset(str(files[None]), "LZ4")


def test_a_header_that_claims_a_huge_record_costs_only_what_the_file_holds(tmp_path):
    path = tmp_path / "huge.tfrecord"
    length = (2**40).to_bytes(8, "little")
    crc = compiled.crc32c(np.frombuffer(length, np.uint8))
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    path.write_bytes(length + masked.to_bytes(4, "little") + b"x" * 10)
    with pytest.raises(DataLossError, match="truncated record at 0"):
        list(TFRecordDataset(str(path)))


def test_crc32c_is_castagnolis():
    assert compiled.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the check value
    data = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint8)
    assert compiled.crc32c(data) == reference.crc32c(data)
    assert compiled.crc32c(data[1000:], compiled.crc32c(data[:1000])) == compiled.crc32c(data)
    for n in range(40):  # eight bytes a step, and every tail of fewer
        part = data[3 : 3 + n]
        assert compiled.crc32c(part, 77) == reference.crc32c(part, 77), n


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_record_splitter_is_its_python_twin_on_any_cut_or_damage(data):
    """Valid TFRecord bytes cut anywhere, with a byte flipped or not: the compiled splitter
    and its twin take the same records and say the same of the rest."""
    raw = base64.b64decode(TF["files"][""])
    cut = data.draw(st.integers(0, len(raw)))
    buf = bytearray(raw[:cut])
    if buf and data.draw(st.booleans()):
        buf[data.draw(st.integers(0, len(buf) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    view = np.frombuffer(bytes(buf), np.uint8)
    assert compiled.tfrecord_split(view) == reference.tfrecord_split(view)


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_the_writer_writes_what_tensorflow_writes(tmp_path, compression):
    """Plain, the file is TensorFlow's byte for byte; compressed, its records read back
    here (the compressors' own bytes may differ) and decompress to TF's framing."""
    path = tmp_path / "out.tfrecord"
    with TFRecordWriter(str(path), compression) as writer:
        for record in RECORDS:
            writer.write(record)
    assert list(TFRecordDataset(str(path), compression)) == RECORDS
    tf_file = base64.b64decode(TF["files"][compression or ""])
    if compression is None:
        assert path.read_bytes() == tf_file
    elif compression == "GZIP":
        assert gzip.decompress(path.read_bytes()) == gzip.decompress(tf_file)
    else:
        assert zlib.decompress(path.read_bytes()) == zlib.decompress(tf_file)
    with pytest.raises(InvalidArgumentError, match="is closed"):
        writer.write(b"late")
    with pytest.raises(InvalidArgumentError, match="options must be"):
        TFRecordWriter(str(path), "LZ4")
    with TFRecordWriter(str(tmp_path / "other"), compression) as other:
        with pytest.raises(InvalidArgumentError, match="a record must be bytes"):
            other.write("text")
