"""Checkpoint and delta data carry checksums, checked on every read: one flipped bit in a
file's data fails a restore (before anything changed), ``load_variables`` and the feed,
naming the file and the tensor; an undamaged file reads as it was written."""

from __future__ import annotations

import json
import os

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain._formats.files.checksums import CHECK_CHUNK, StreamDigests, Verifier, digests_of
from pstrain._formats.files.tensor_files import DIGEST_PREFIX
from pstrain.checkpoint import load_variables
from pstrain.errors import InvalidArgumentError
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(120)


def _flip(path: str, key: str | None = None, at: float = 0.5) -> str:
    """Flip one bit in the data of tensor ``key`` (the largest, if None) of safetensors file
    ``path``, ``at`` of the way in; returns the key."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    if key is None:
        key = max(header, key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    begin, end = header[key]["data_offsets"]
    where = 8 + n + begin + int((end - begin - 1) * at)
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))
    return key


def test_digests_taken_as_bytes_stream_match_those_of_the_whole_and_find_a_flipped_bit():
    data = np.random.default_rng(0).integers(0, 255, 2 * CHECK_CHUNK + 123, dtype=np.uint8)
    stream = StreamDigests(5, [("a", data.size), ("b", 0), ("c", 7)])
    raw = b"hdr!!" + data.tobytes() + b"tail!!!"
    for lo in range(0, len(raw), 1_000_003):  # pieces that do not fall on chunk boundaries
        stream.feed(raw[lo : lo + 1_000_003])
    assert stream.done and stream.digests["a"] == digests_of(data) and stream.digests["b"] == ""
    check = Verifier("f", "a", stream.digests["a"], data.size)
    check.update(data)
    check.finish()
    data[CHECK_CHUNK + 5] ^= 1
    check = Verifier("f", "a", stream.digests["a"], data.size)
    with pytest.raises(InvalidArgumentError, match=r"bytes 4194304\.\.8388608 of tensor 'a'"):
        check.update(data)


async def _saved(root: str, cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        w = pstrain.Variable(np.arange(3 * CHECK_CHUNK // 4, dtype=np.float32).reshape(-1, 4), name="w")
        table = pstrain.DynamicEmbedding(4, name="emb", capacity=1000)
    ckpt = pstrain.Checkpoint(w=w, table=table)
    manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
    await table.lookup(np.arange(200, dtype=np.int64))
    await manager.save()
    await w.assign_add(np.ones(w.shape, np.float32))
    await table.lookup(np.arange(200, 260, dtype=np.int64))
    delta = await manager.save_delta()
    return w, table, ckpt, manager, delta


async def _delta_saved(root: str) -> str:
    """A base and a delta (``_saved``) of a cluster that has stopped since: the delta's path."""
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        *_, manager, delta = await _saved(root, cluster)
        await manager.close()
    return str(delta)


async def test_a_flipped_bit_in_a_delta_fails_restore_load_and_feed_and_changes_nothing(tmp_path):
    root = str(tmp_path)
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        w, table, ckpt, manager, delta = await _saved(root, cluster)
        assert float(load_variables(delta)["w"][0, 0]) == 1.0  # undamaged: reads back
        with open(f"{delta}.index.json") as f:
            index = json.load(f)
        entry = next(iter(index["tables"].values()))
        _flip(os.path.join(root, entry["files"][0]), f"{entry['prefix']}:rows")  # the table's rows
        await w.assign(np.full(w.shape, 7.0, np.float32))
        before = await table.export()
        with pytest.raises(InvalidArgumentError, match="is damaged: bytes .* do not match their checksum"):
            await ckpt.restore(delta)
        assert float((await w.read_value())[0, 0]) == 7.0  # nothing changed
        after = await table.export()
        np.testing.assert_array_equal(after[0], before[0])
        with pytest.raises(InvalidArgumentError, match="do not match their checksum"):
            load_variables(delta)
        url = f"http://{cluster.ps[0].address}/v1/tables/emb/rows"
        async with aiohttp.ClientSession() as session:  # the feed reads the damaged delta too
            async with session.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 400  # each ps reads every file of a save (ids hash anywhere)
                assert "do not match their checksum" in (await r.json())["error"]["message"]
        await manager.close()


async def test_a_flipped_bit_in_a_full_save_fails_a_restore_into_another_number_of_ps(tmp_path):
    root = str(tmp_path)
    async with InProcessCluster(num_ps=1, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(1)
        )
        with strategy.scope():
            w = pstrain.Variable(np.ones((CHECK_CHUNK // 2, 4), np.float32), name="w")  # 2 chunks x 4
        path = await pstrain.Checkpoint(w=w).save(f"{root}/ckpt")
    part = next(f for f in os.listdir(root) if f.endswith(".safetensors"))
    _flip(os.path.join(root, part), at=0.9)  # in the last rows: the part a second ps reads
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        with strategy.scope():
            w = pstrain.Variable(np.zeros((CHECK_CHUNK // 2, 4), np.float32), name="w")
        with pytest.raises(InvalidArgumentError, match="do not match their checksum"):
            await pstrain.Checkpoint(w=w).restore(path)
        assert float((await w.read_value()).sum()) == 0.0


async def test_a_checksum_renamed_in_a_header_fails_the_read_not_skips_the_check(tmp_path):
    """One changed byte in a file's header that renames a tensor's checksum (its data then
    damaged too) was read as a file from before checksums, unchecked: the restored values
    were the damaged ones. A file with checksums must have one for every tensor."""
    root = str(tmp_path)
    delta = await _delta_saved(root)
    with open(f"{delta}.index.json") as f:
        index = json.load(f)
    path = os.path.join(root, index["variables"]["w"]["parts"][0]["file"])
    key = _flip(path, f"v:{index['variables']['w']['parts'][0]['key']}:rows")  # the data
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        name = f"{DIGEST_PREFIX}{key}".encode()
        assert header.count(name) == 1
        f.seek(8 + header.index(name) + len(name) - 1)
        f.write(b"!")  # the checksum's name, one byte off
    with pytest.raises(InvalidArgumentError, match="its header is damaged: the checksums name other tensors"):
        load_variables(delta)


async def test_a_bit_flipped_in_an_index_fails_the_read(tmp_path):
    """The files' checksums cover the tensors; an index's digest covers where they are. One
    bit of a digit of an offset in a delta's index, or of a shape in a full save's, made
    the read take other rows or fail elsewhere, and it fails as damaged now; without its
    digest (an index of pstrain 0.2) the index is read as before."""
    root = str(tmp_path)
    delta = await _delta_saved(root)
    want = load_variables(delta)
    base = delta.rsplit(".delta-", 1)[0]
    for prefix, field in ((delta, b'"offset"'), (base, b'"rows"')):
        path = f"{prefix}.index.json"
        with open(path, "rb") as f:
            good = f.read()
        text = bytearray(good)
        at = good.index(field, good.index(b'"w"'))
        while not chr(text[at]).isdigit():
            at += 1
        text[at] ^= 0x01  # a digit one bit off
        with open(path, "wb") as f:
            f.write(bytes(text))
        with pytest.raises(InvalidArgumentError, match="does not match its digest"):
            load_variables(delta)
        index = json.loads(good)
        del index["digest"]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(index, f)
        got = load_variables(delta)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
