"""``pstrain.data.TextLineDataset`` against TensorFlow's own lines
(``references/make_references.py tf_text_lines``): files with ``\\n`` and ``\\r\\n``, empty
lines, a last line without an ending, an empty file and a long line, plain, GZIP and ZLIB,
one after another and read side by side; then refusals, and lines longer than a read."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from pstrain.data import Dataset, TextLineDataset
from pstrain.errors import DataLossError, InvalidArgumentError, NotFoundError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TF = json.loads((Path(__file__).resolve().parent / "references" / "tf_text_lines.json").read_text())
SUFFIX = {None: "", "GZIP": ".gz", "ZLIB": ".z"}


@pytest.fixture
def files(tmp_path):
    for name, text in TF["files"].items():
        data = text.encode()
        (tmp_path / name).write_bytes(data)
        (tmp_path / (name + ".gz")).write_bytes(gzip.compress(data))
        (tmp_path / (name + ".z")).write_bytes(zlib.compress(data))
    return tmp_path


def test_lines_are_tensorflows(files):
    assert len(TF["cases"]) == 27
    for case in TF["cases"]:
        paths = [str(files / (f + SUFFIX[case["compression"]])) for f in case["files"]]
        got = TextLineDataset(paths, case["compression"], num_parallel_reads=case["parallel"])
        assert [x.decode() for x in got] == case["lines"], case
        # read a few bytes at a time: lines across reads are joined as they were
        small = TextLineDataset(
            paths, case["compression"], buffer_size=3, num_parallel_reads=case["parallel"]
        )
        assert [x.decode() for x in small] == case["lines"], case


def test_file_names_come_as_a_path_a_list_or_a_dataset_and_lines_batch(files):
    a = files / "a.txt"
    want = TF["files"]["a.txt"].replace("\r\n", "\n").split("\n")
    assert [x.decode() for x in TextLineDataset(a)] == want  # a PathLike alone
    assert [x.decode() for x in TextLineDataset(str(a).encode())] == want
    names = Dataset.from_tensor_slices(np.array([str(files / "b.txt"), str(a)]))
    assert [x.decode() for x in TextLineDataset(names)] == ["x", "y", "z", *want]
    ds = TextLineDataset([str(a)])
    assert ds.cardinality() == -2 and ds.element_spec.shape == () and ds.element_spec.dtype.kind == "O"
    first = next(iter(ds.batch(3)))  # an array of objects, as TF's numpy batches of strings
    assert first.dtype == object and first.tolist() == [b"a,1", b"b,2", b""]
    assert list(TextLineDataset([])) == []


def test_what_cannot_be_read_is_refused_by_name(files):
    with pytest.raises(NotFoundError, match="nope.txt: no such file"):
        list(TextLineDataset(str(files / "nope.txt")))
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        list(TextLineDataset(str(files)))
    with pytest.raises(DataLossError, match="is not whole GZIP data"):  # (TF's error, too)
        list(TextLineDataset(str(files / "a.txt"), "GZIP"))
    with pytest.raises(DataLossError, match="is not whole ZLIB data"):
        list(TextLineDataset(str(files / "a.txt"), "ZLIB"))
    cut = files / "cut.z"
    cut.write_bytes(zlib.compress(b"one\ntwo\n" * 100)[:-6])
    lines = []  # the lines before the cut come first (TF's too; TF then ends quietly)
    with pytest.raises(DataLossError, match="cut.z ends inside its ZLIB data"):
        lines.extend(TextLineDataset(str(cut), "ZLIB"))
    assert len(lines) >= 190 and set(lines) == {b"one", b"two"}
    after = files / "after.z"
    after.write_bytes(zlib.compress(b"one\n") + b"more")
    with pytest.raises(DataLossError, match="after.z has bytes after its ZLIB stream"):
        list(TextLineDataset(str(after), "ZLIB"))
    for kwargs, match in (
        ({"compression_type": "BZ2"}, "compression_type must be None, '', 'GZIP' or 'ZLIB'"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"num_parallel_reads": 0}, "num_parallel_reads"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            TextLineDataset(str(files / "a.txt"), **kwargs)
    with pytest.raises(InvalidArgumentError, match="filenames must be paths"):
        TextLineDataset([3])


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_every_carriage_return_of_a_line_is_dropped_as_tensorflows_reader_drops_it(tmp_path, compression):
    """TF's reader (``BufferedInputStream::ReadLine``) drops every ``\\r`` of a line, not
    only one before its ``\\n``, and a last line of nothing but ``\\r`` is no line: lines
    read off TensorFlow 2.21 on the same bytes, read here a byte to three at a time (the
    ``\\r`` of a line kept, but the one before the ``\\n``, before)."""
    data = b"a\rb\r\n\xff\x00\r\x00a\r\xff \n\ra\x00\r\r\n\r\r\n\n b\r"
    want = [b"ab", b"\xff\x00\x00a\xff ", b"a\x00", b"", b"", b" b"]
    raw = {None: data, "GZIP": gzip.compress(data), "ZLIB": zlib.compress(data)}[compression]
    path = tmp_path / "lines"
    path.write_bytes(raw)
    for buffer_size in (1, 2, 3, 1 << 16):
        assert list(TextLineDataset(str(path), compression, buffer_size=buffer_size)) == want
    path.write_bytes(
        {None: b"x\n\r\r", "GZIP": gzip.compress(b"x\n\r\r"), "ZLIB": zlib.compress(b"x\n\r\r")}[compression]
    )
    assert list(TextLineDataset(str(path), compression)) == [b"x"]


def test_gzip_members_one_after_another_are_one_file_as_tensorflow_reads_them(tmp_path):
    """``cat a.gz b.gz``: every member's lines in turn (an empty member too), as TF 2.21
    reads the same bytes; read a byte at a time as well."""
    path = tmp_path / "joined.gz"
    path.write_bytes(gzip.compress(b"a\nb\n") + gzip.compress(b"c\nd") + gzip.compress(b""))
    for buffer_size in (1, 1 << 16):
        assert list(TextLineDataset(str(path), "GZIP", buffer_size=buffer_size)) == [b"a", b"b", b"c", b"d"]
