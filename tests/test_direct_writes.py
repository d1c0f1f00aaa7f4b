"""Checkpoint files written past the page cache (O_DIRECT) hold exactly the bytes given, with
O_DIRECT or without it (a file system that has none), across the staging buffer's edges."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import load_file

from pstrain._formats import direct_writes, tensor_files
from pstrain._formats.direct_writes import ALIGN, DirectWriter
from pstrain._formats.tensor_files import whole, write_streaming
from pstrain.errors import AlreadyExistsError

pytestmark = pytest.mark.timeout(120)

#: Sizes around the alignment and the (shrunk) staging buffer's edges.
SIZES = st.one_of(st.integers(0, 3 * ALIGN + 7), st.sampled_from([ALIGN - 1, ALIGN, ALIGN + 1,
                                                                  2 * ALIGN, 3 * ALIGN]))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(direct_writes, "CHUNK", 2 * ALIGN)  # many buffer refills per file


def _write(path, pieces: list[bytes]) -> DirectWriter:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writer = DirectWriter(fd)
        for piece in pieces:
            assert writer.write(piece) == len(piece)
        writer.finish()
    finally:
        os.close(fd)
    return writer


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(SIZES, max_size=6), direct=st.booleans())
def test_a_file_holds_exactly_the_bytes_written_with_or_without_o_direct(tmp_path_factory, sizes,
                                                                           direct):
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    path = tmp_path_factory.mktemp("direct") / "f"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(direct_writes, "CHUNK", 2 * ALIGN)
        if not direct:  # a platform or file system without O_DIRECT
            mp.delattr(os, "O_DIRECT", raising=False)
        writer = _write(path, pieces)
    assert path.read_bytes() == b"".join(pieces)
    if not direct:
        assert not writer.direct


def test_the_disk_under_the_tests_takes_o_direct(tmp_path):
    # Otherwise the test above would only ever check the page-cache path.
    writer = _write(tmp_path / "f", [b"x" * 10])
    assert writer.direct and (tmp_path / "f").read_bytes() == b"x" * 10


def test_a_streamed_checkpoint_file_reads_back_with_safetensors(tmp_path, small_chunks):
    rng = np.random.default_rng(0)
    tensors = {"rows": rng.standard_normal((1001, 7)).astype(np.float32),
               "idx": np.arange(1001, dtype=np.int64), "empty": np.zeros((0, 3), np.float64),
               "flag": np.array([True, False, True])}
    path = str(tmp_path / "c.safetensors")
    size = write_streaming(path, [whole(k, v) for k, v in tensors.items()])
    assert size == os.path.getsize(path)
    back = load_file(path)
    for key, value in tensors.items():
        np.testing.assert_array_equal(back[key], value)
    with pytest.raises(AlreadyExistsError):  # never written over
        write_streaming(path, [whole("rows", tensors["rows"])])
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


def test_rows_read_back_in_pieces_are_the_rows_written(tmp_path, monkeypatch):
    # A restore reads in pieces and lets the page cache's copy go behind it: every piece,
    # the odd-sized last one too, lands where it belongs.
    monkeypatch.setattr(tensor_files, "READ_CHUNK", ALIGN + 3)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((3001, 5)).astype(np.float32)
    base = str(tmp_path / "base.safetensors")
    write_streaming(base, [whole("t", table)])
    delta = str(tmp_path / "delta.safetensors")
    idx = np.array([5, 2999, 1000], np.int64)
    write_streaming(delta, [whole("rows", -table[idx]), whole("idx", idx)])
    got = tensor_files.read_rows((2000, 5), np.dtype(np.float32), [[base, "t", 1001, 3001, 0]],
                                 [[delta, "rows", "idx", -1001]])
    want = table[1001:].copy()
    want[2999 - 1001] = -table[2999]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tensor_files.read_tensor(base, "t"), table)
