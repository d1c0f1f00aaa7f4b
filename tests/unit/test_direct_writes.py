"""Checkpoint files written past the page cache (O_DIRECT) hold exactly the bytes given, with
O_DIRECT or without it (a file system that has none), across the staging buffer's edges."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import load_file

from pstrain._formats.files import direct_writes, tensor_files
from pstrain._formats.files.direct_writes import ALIGN, DirectWriter
from pstrain._formats.files.tensor_files import whole, write_streaming
from pstrain.errors import AlreadyExistsError, PstrainError

pytestmark = pytest.mark.timeout(120)

#: Sizes around the alignment and the (shrunk) staging buffer's edges.
SIZES = st.one_of(
    st.integers(0, 3 * ALIGN + 7), st.sampled_from([ALIGN - 1, ALIGN, ALIGN + 1, 2 * ALIGN, 3 * ALIGN])
)


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
def test_a_file_holds_exactly_the_bytes_written_with_or_without_o_direct(tmp_path_factory, sizes, direct):
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
    tensors = {
        "rows": rng.standard_normal((1001, 7)).astype(np.float32),
        "idx": np.arange(1001, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float64),
        "flag": np.array([True, False, True]),
    }
    path = str(tmp_path / "c.safetensors")
    size = write_streaming(path, [whole(k, v) for k, v in tensors.items()])
    assert size == os.path.getsize(path)
    back = load_file(path)
    for key, value in tensors.items():
        np.testing.assert_array_equal(back[key], value)
    with pytest.raises(AlreadyExistsError):  # never written over
        write_streaming(path, [whole("rows", tensors["rows"])])
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_a_file_taken_away_during_its_save_fails_the_save_with_pstrains_error(tmp_path, overwrite, direct):
    # What a process with write access to the folder can do while a save runs (the race
    # tests/cluster/test_security.py runs at speed): take the temporary name away before it is
    # renamed or linked to its own. The save fails with pstrain's error, naming the file,
    # not with the rename's OSError, and nothing is left under either name.
    def write(f) -> None:
        f.write(b"x" * 5000)
        for entry in os.scandir(tmp_path):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)

    path = str(tmp_path / "c.index.json")
    with pytest.raises(PstrainError, match="c.index.json: the file written was removed"):
        tensor_files.write_atomically(path, write, overwrite=overwrite, direct=direct)
    assert list(tmp_path.iterdir()) == []


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
    got = tensor_files.read_rows(
        (2000, 5), np.dtype(np.float32), [[base, "t", 1001, 3001, 0]], [[delta, "rows", "idx", -1001]]
    )
    want = table[1001:].copy()
    want[2999 - 1001] = -table[2999]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tensor_files.read_tensor(base, "t"), table)


class _Clock:
    """Time that passes only when the writer sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5 * ALIGN), max_size=8),
    rate=st.integers(ALIGN, 8 * ALIGN),
    ahead=st.sampled_from([0, 3 * ALIGN, 64 * ALIGN]),
)
def test_a_paced_writer_never_gets_ahead_of_its_rate_and_never_waits_for_nothing(
    tmp_path_factory, sizes, rate, ahead
):
    path = tmp_path_factory.mktemp("paced") / "f"
    clock = _Clock()
    sent: list[tuple[float, int]] = []  # (time, bytes handed over before it) at each buffer
    staged: list[int] = []  # bytes the writer held when each buffer went out
    pieces = [bytes([k % 251]) * n for k, n in enumerate(sizes)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(direct_writes, "CHUNK", 2 * ALIGN)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer = DirectWriter(fd, rate, ahead=ahead, clock=clock, sleep=clock.sleep)
            send = writer._send

            def watched(lo: int, hi: int) -> None:
                before = writer._sent
                staged.append(writer.fill)
                send(lo, hi)
                sent.append((clock.now, before))

            mp.setattr(writer, "_send", watched)
            for piece in pieces:
                writer.write(piece)
            writer.finish()
        finally:
            os.close(fd)
    total = sum(sizes)
    assert path.read_bytes() == b"".join(pieces)
    for at, before in sent:  # each buffer went out no earlier than the bytes before it were due
        assert at >= before / rate - 1e-9
    if sent:  # ... and no later: the writer only waits for that
        assert clock.now == pytest.approx(sent[-1][1] / rate)
        # nothing went out before the writer held all it stages ahead (a delta's rows
        # gathered in one burst, then sent at the rate)
        assert writer.capacity >= max(ahead, 2 * ALIGN)
        assert staged[0] == min(total, writer.capacity)
    assert all(s > 0 for s in clock.sleeps)
    if len(sent) <= 1:
        assert clock.sleeps == []  # a file of one buffer goes out at once


@settings(max_examples=100, deadline=None)
@given(held=st.integers(0, 1 << 42))
def test_a_paced_write_stages_at_most_a_quarter_of_what_its_ps_holds(held):
    ahead = direct_writes.ahead_for(held)
    assert ahead & (ahead - 1) == 0  # a power of two: files of about one size share a buffer
    assert direct_writes.CHUNK <= ahead <= direct_writes.MAX_AHEAD
    assert ahead <= max(direct_writes.CHUNK, held // 4)
    assert ahead * 2 > min(direct_writes.MAX_AHEAD, max(direct_writes.CHUNK, held // 4))


def test_a_threads_staging_buffer_is_reused_and_given_back(tmp_path, small_chunks):
    def staged(name: str, ahead: int) -> np.ndarray:
        fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer = DirectWriter(fd, 1e12, ahead=ahead)
            writer.write(b"x" * 100)
            writer.finish()
            return writer.buffer
        finally:
            os.close(fd)

    big = staged("a", 40 * ALIGN)
    again = staged("b", 50 * ALIGN)  # about the same size: the same memory, no pages anew
    assert big.size == again.size == 64 * ALIGN
    assert again.ctypes.data == big.ctypes.data
    small = staged("c", 0)  # a quarter of it or less: the memory is given back
    assert small.size == 2 * ALIGN and small.ctypes.data != big.ctypes.data
    assert (tmp_path / "c").read_bytes() == b"x" * 100


def test_a_streamed_file_spread_over_some_seconds_takes_them(tmp_path, small_chunks):
    # 40 buffers of 8 KiB spread over 0.4 s: the 40th may start no earlier than 39/40 of it.
    data = np.arange(40 * 2 * ALIGN // 4, dtype=np.float32)
    t = time.monotonic()
    write_streaming(str(tmp_path / "f.safetensors"), [whole("x", data)], write_s=0.4)
    assert time.monotonic() - t >= 0.38 * (data.nbytes - 2 * ALIGN) / data.nbytes
    np.testing.assert_array_equal(load_file(str(tmp_path / "f.safetensors"))["x"], data)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_a_writer_refuses_a_rate_that_is_not_positive(tmp_path, rate):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with pytest.raises(ValueError, match="rate must be a positive number"):
            DirectWriter(fd, rate)
    finally:
        os.close(fd)
