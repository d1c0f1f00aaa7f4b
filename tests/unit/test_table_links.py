"""A full save's table file that links earlier files (``_formats/files/table_links.py``):
read as one save with its links, the links' bits in place of their own ``live``; a link
that is not the file linked, or bits that are not a link's, refused by name; a save that
fails removes the links it made."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pstrain._formats.files.delta_files import read_table_plan
from pstrain._formats.files.table_links import link_name, pack
from pstrain._formats.files.tensor_files import write_tensors
from pstrain.errors import InvalidArgumentError
from pstrain.server.ps.checkpoints.saves import CheckpointFiles
from pstrain.server.ps.store import VariableStore

pytestmark = pytest.mark.timeout(60)
DIM = 4


def _table(ids, **extra) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, np.int64)
    rows = (ids[:, None] + np.arange(DIM) / 10).astype(np.float32)
    return {"ids": ids, "rows": rows, "slot:acc": rows * 2, "init:acc": np.array([0.1]), **extra}


def _saved(tmp_path, mask, bits=None) -> str:
    """A base file of ids 0..9 (none live by its own mask), and a table file of ids 10..12
    that links it, taking the rows ``mask`` says (or ``bits`` as they are)."""
    base = str(tmp_path / "old.ps0.table-t.safetensors")
    write_tensors(base, _table(range(10), live=np.zeros(10, bool)))
    path = str(tmp_path / "new.ps0.table-t.safetensors")
    linked = pack(mask) if bits is None else bits
    write_tensors(path, _table([10, 11, 12], live=np.ones(3, bool), **{"linked:0": linked}))
    os.link(base, link_name(path, 0))
    return path


def test_a_table_file_and_its_links_read_as_one_save(tmp_path):
    mask = np.zeros(10, bool)
    mask[[1, 4, 9]] = True
    path = _saved(tmp_path, mask)
    ids, rows, slots, init = read_table_plan([path], [], 0, 1, DIM, np.dtype(np.float32)).read_whole()
    want = _table([10, 11, 12, 1, 4, 9])
    np.testing.assert_array_equal(ids, want["ids"])
    np.testing.assert_array_equal(rows, want["rows"])
    np.testing.assert_array_equal(slots["acc"], want["slot:acc"])
    assert init == {"acc": 0.1}
    # as pieces (a tiered restore's), the same rows, the link a base file of its own
    plan = read_table_plan([path], [], 0, 1, DIM, np.dtype(np.float32))
    assert [os.path.basename(f.path) for f in plan.base] == [
        "new.ps0.table-t.safetensors",
        "new.ps0.table-t.link-0.safetensors",
    ]
    pieces = list(plan.pieces())
    np.testing.assert_array_equal(np.concatenate([p[0] for p in pieces]), want["ids"])
    np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), want["rows"])
    np.testing.assert_array_equal(np.concatenate([p[2]["acc"] for p in pieces]), want["slot:acc"])


def test_a_link_that_is_not_the_file_linked_is_refused_by_name(tmp_path):
    path = _saved(tmp_path, np.ones(7, bool))  # bits for a file of 7 rows: not this one
    with pytest.raises(InvalidArgumentError, match=r"link-0.*holds 10 rows.*links 1 bytes.*another file"):
        read_table_plan([path], [], 0, 1, DIM, np.dtype(np.float32))


@pytest.mark.parametrize(
    ("bits", "message"),
    [
        (np.ones(2, np.int64), r"linked:0 in .* is int64 \(2,\), not a link's bits"),
        (np.full(2, 255, np.uint8), r"holds 10 rows, but .* links 2 bytes"),  # rows 10..15 set
        (np.ones(3, np.uint8), r"holds 10 rows, but .* links 3 bytes"),
    ],
)
def test_bits_that_are_not_a_links_are_refused(tmp_path, bits, message):
    path = _saved(tmp_path, None, bits)
    with pytest.raises(InvalidArgumentError, match=message):
        read_table_plan([path], [], 0, 1, DIM, np.dtype(np.float32))


async def test_a_save_that_fails_removes_the_links_it_made(tmp_path):
    source = str(tmp_path / "tier.ref")
    write_tensors(source, _table(range(3)))
    files = CheckpointFiles(VariableStore("ps0"), str(tmp_path))
    path = str(tmp_path / "ckpt.ps0.table-t.safetensors")
    # a tensor that gives fewer bytes than its shape: the write fails after the link is made
    pending = files.take(path, [("ids", np.dtype(np.int64), (4,), lambda: iter([np.zeros(3, np.int64)]))])
    pending.links.append((source, link_name(path, 0)))
    with pytest.raises(InvalidArgumentError, match="gave 24 bytes, not 32"):
        await files.write(pending)
    assert sorted(os.listdir(tmp_path)) == ["tier.ref"]
    assert os.stat(source).st_nlink == 1


def test_a_link_that_is_a_symbolic_link_is_not_followed(tmp_path):
    path = _saved(tmp_path, np.ones(10, bool))
    link = link_name(path, 0)
    os.unlink(link)
    os.symlink(tmp_path / "old.ps0.table-t.safetensors", link)  # (it could point anywhere)
    with pytest.raises(InvalidArgumentError, match=r"cannot (open checkpoint file|read) .*link-0"):
        read_table_plan([path], [], 0, 1, DIM, np.dtype(np.float32))
