"""Rows of many variables in one pair of arrays (``PackedRows``): what a collection's step
sends each ps. A packed read gives the same rows as reads one by one, a packed gradient
the same update as gradients one by one, and a malformed one is refused whole."""

from __future__ import annotations

import numpy as np
import pytest

import pstrain
from pstrain._base.tags import set_dispatch
from pstrain._formats.messages.operations import (
    MORE_GRADS,
    ApplyGradients,
    ListVariables,
    OptimizerStep,
    PackedRows,
    RowRead,
    SparseRead,
)
from pstrain._formats.messages.records import OptimizerRule
from pstrain._training.optimizers import _packed
from pstrain.errors import InvalidArgumentError, NotFoundError
from tests.helpers import strategy_for

pytestmark = pytest.mark.timeout(60)

ADAGRAD = OptimizerRule(kind="adagrad", learning_rate=0.1, initial_accumulator_value=0.1, epsilon=1e-7)


async def _tables(ps_server, prefix, widths=(3, 3, 3)):
    async with strategy_for(ps_server).scope():
        rng = np.random.default_rng(len(prefix))
        return [
            pstrain.Variable(rng.standard_normal((20 + 5 * k, w)).astype(np.float32), name=f"{prefix}{k}")
            for k, w in enumerate(widths)
        ]


async def test_a_packed_read_gives_each_variables_rows_in_one_array_after_the_other_reads(ps_server):
    tables = await _tables(ps_server, "r")
    whole = tables[2]
    ids = [np.array([0, 7, 19], np.int32), np.array([], np.int32), np.array([24, 3], np.int32)]
    packed = PackedRows(
        names=[t.key for t in tables], counts=np.array([i.size for i in ids]), rows=np.concatenate(ids)
    )
    reply = await tables[0].channel().request(SparseRead(reads=[RowRead(name=whole.key)], packed=packed))
    assert len(reply.values) == 2
    values = [await t.numpy() for t in tables]
    np.testing.assert_array_equal(reply.values[0], values[2])
    want = np.concatenate([v[i] for v, i in zip(values, ids)])
    np.testing.assert_array_equal(reply.values[1], want)
    # packed alone, and rows asked for twice
    twice = PackedRows(names=[tables[1].key] * 2, counts=np.array([1, 2]), rows=np.array([4, 4, 0]))
    reply = await tables[0].channel().request(SparseRead(packed=twice))
    np.testing.assert_array_equal(reply.values[0], values[1][[4, 4, 0]])


async def test_packed_gradients_update_as_the_same_gradients_one_by_one(ps_server):
    packed_tables = await _tables(ps_server, "p")
    plain_tables = await _tables(ps_server, "q")
    rng = np.random.default_rng(3)
    for step in range(3):
        rows = [np.sort(rng.choice(t.shape[0], 6, replace=False)).astype(np.int32) for t in packed_tables]
        grads = [rng.standard_normal((6, 3)).astype(np.float32) for _ in packed_tables]
        dense = rng.standard_normal(plain_tables[0].shape).astype(np.float32)
        packed = PackedRows(
            names=[t.key for t in packed_tables[1:]],
            counts=np.array([6, 6]),
            rows=np.concatenate(rows[1:]),
            values=np.concatenate(grads[1:]),
        )
        # the first table's gradient whole (dense), the others' packed, in one request
        await (
            packed_tables[0]
            .channel()
            .request(
                ApplyGradients(
                    rule=ADAGRAD,
                    prefix="A",
                    grads=[[packed_tables[0].key, None, dense]],
                    packed=packed,
                    unique_rows=True,
                )
            )
        )
        one_by_one = [[plain_tables[0].key, None, dense]]
        one_by_one += [[t.key, r, g] for t, r, g in zip(plain_tables[1:], rows[1:], grads[1:])]
        await (
            plain_tables[0]
            .channel()
            .request(ApplyGradients(rule=ADAGRAD, prefix="A", grads=one_by_one, unique_rows=True))
        )
        for a, b in zip(packed_tables, plain_tables):
            np.testing.assert_array_equal(await a.numpy(), await b.numpy(), err_msg=f"step {step}")


def _bad(keys):
    """(packed fields, the error, what it says, the ops refusing it) for malformed packed
    rows of ``keys``."""
    two = [keys[0], keys[1]]
    values = np.ones((3, 3), np.float32)
    both, apply = ("read", "apply"), ("apply",)
    bad = InvalidArgumentError
    return [
        ({"names": two, "counts": np.array([3]), "rows": np.arange(3)}, bad, "one integer count", both),
        ({"names": two, "counts": np.array([1.0, 2.0]), "rows": np.arange(3)}, bad, "integer", both),
        ({"names": two, "counts": np.array([4, -1]), "rows": np.arange(3)}, bad, "negative count", both),
        ({"names": two, "counts": np.array([1, 1]), "rows": np.arange(3)}, bad, "add up to 2", both),
        ({"names": two, "counts": np.array([1, 2]), "rows": np.zeros((3, 1), int)}, bad, "1-D", both),
        ({"names": two, "counts": np.array([1, 2]), "rows": np.zeros(3)}, bad, "integers", both),
        (
            {"names": two, "counts": np.array([1, 2]), "rows": np.arange(3), "values": values[:2]},
            bad,
            "3 rows",
            apply,
        ),
        ({"names": two, "counts": np.array([1, 2]), "rows": np.array([0, 1, 99])}, bad, "out of range", both),
        (
            {"names": [keys[0], "nope"], "counts": np.array([1, 2]), "rows": np.arange(3)},
            NotFoundError,
            "nope",
            both,
        ),
    ]


@pytest.mark.parametrize("case", range(9))
async def test_a_malformed_packed_request_is_refused_naming_what_and_changes_nothing(ps_server, case):
    tables = await _tables(ps_server, "b", widths=(3, 3, 2))
    fields, error, message, ops = _bad([t.key for t in tables])[case]
    before = [await t.numpy() for t in tables]
    channel = tables[0].channel()
    if "read" in ops:
        with pytest.raises(error, match=message):
            await channel.request(SparseRead(packed=PackedRows(**fields)))
    with pytest.raises(error, match=message):
        await channel.request(
            ApplyGradients(
                rule=ADAGRAD,
                prefix="A",
                grads=[[tables[2].key, None, np.ones((30, 2), np.float32)]],  # valid: still not applied
                packed=PackedRows(**{"values": np.ones((3, 3), np.float32), **fields}),
            )
        )
    for t, was in zip(tables, before):
        np.testing.assert_array_equal(await t.numpy(), was)
    listed = await channel.request(ListVariables())
    assert not any(v.name.startswith("A/") for v in listed.variables)  # no slot made


async def test_packed_reads_of_variables_that_differ_in_row_shape_or_gradients_without_values_are_refused(
    ps_server,
):
    tables = await _tables(ps_server, "d", widths=(3, 2))
    channel = tables[0].channel()
    mixed = PackedRows(names=[t.key for t in tables], counts=np.array([1, 1]), rows=np.array([0, 0]))
    with pytest.raises(InvalidArgumentError, match="row shapes must agree"):
        await channel.request(SparseRead(packed=mixed))
    with pytest.raises(InvalidArgumentError, match="need their values"):
        await channel.request(ApplyGradients(rule=ADAGRAD, prefix="A", grads=[], packed=mixed))


def test_gradients_are_packed_when_two_or_more_are_alike_and_every_variable_is_named_once():
    f32 = np.ones((2, 4), np.float32)
    rows = np.array([0, 5], np.int32)
    grads = [["a", rows, f32], ["b", None, np.ones(3, np.float32)], ["c", rows, f32], ["d", rows, f32[:, :2]]]
    rest, packed = _packed(grads)
    assert [g[0] for g in rest] == ["b", "d"]  # the dense one, and the one of another row shape
    assert packed is not None and packed.names == ["a", "c"] and packed.counts.tolist() == [2, 2]
    np.testing.assert_array_equal(packed.rows, [0, 5, 0, 5])
    assert packed.values.shape == (4, 4)
    for unpacked in (grads[:2] + grads[3:], [*grads, ["a", rows, f32]]):  # one alike; "a" twice
        rest, packed = _packed(unpacked)
        assert packed is None and rest == unpacked


async def _collection(strategy, name):
    async with strategy.scope():
        collection = pstrain.EmbeddingCollection(
            [
                pstrain.TableConfig(
                    f"t{k}",
                    30 + k,
                    4,
                    [f"f{k}"],
                    initializer=pstrain.initializers.RandomUniform(-0.1, 0.1, seed=k),
                )
                for k in range(6)
            ],
            name=name,
        )
        opt = pstrain.optimizers.Adagrad(0.2, initial_accumulator_value=0.1, name=f"{name}/opt")
    return collection, opt


async def _collection_step(collection, opt, features, only_ps=None):
    pooled = await collection.lookup(features)
    x = pooled.concat()  # every table's gradient depends on every table's rows
    grads = pooled.gradients(np.cos(x + x.sum(axis=1, keepdims=True)) + 0.5)
    if only_ps is not None:  # an attempt whose other request never arrived
        grads = [(g, t) for g, t in grads if t.ps_index == only_ps]
    await collection.apply_gradients(grads, opt)


async def test_a_rerun_reads_packed_rows_as_its_first_attempt_did(ps_pair):
    """An exactly-once closure's first attempt updates the tables on ps 0 only (packed);
    its rerun reads (packed) the rows as they were before that, and the tables end as in a
    run without the fault."""
    strategy = strategy_for(*ps_pair)
    want, want_opt = await _collection(strategy, "want")
    got, got_opt = await _collection(strategy, "got")
    assert sum(t.ps_index == 0 for t in got.tables.values()) >= 2  # packed on ps 0
    rng = np.random.default_rng(5)
    for step in range(3):
        features = {f"f{k}": pstrain.JaggedTensor(rng.integers(0, 30, 12), [3, 0, 5, 4]) for k in range(6)}
        await _collection_step(want, want_opt, features)
        key = f"packed-{step}"
        set_dispatch(None, key)
        try:
            await _collection_step(got, got_opt, features, only_ps=0)
            set_dispatch(None, key)  # the rerun
            await _collection_step(got, got_opt, features)
        finally:
            set_dispatch(None, None)
        for name in want.tables:
            np.testing.assert_array_equal(
                await got.tables[name].numpy(), await want.tables[name].numpy(), err_msg=f"step {step} {name}"
            )


async def test_a_step_in_more_packing_past_its_limit_of_variables_is_refused(ps_server):
    tables = await _tables(ps_server, "m")
    n = MORE_GRADS + 1
    packed = PackedRows(
        names=[tables[0].key] * n,
        counts=np.ones(n, np.int64),
        rows=np.zeros(n, np.int64),
        values=np.ones((n, 3), np.float32),
    )
    more = OptimizerStep(rule=ADAGRAD, prefix="B", grads=[], packed=packed)
    before = await tables[0].numpy()
    with pytest.raises(InvalidArgumentError, match=f"at most {MORE_GRADS} variables"):
        await tables[0].channel().request(ApplyGradients(rule=ADAGRAD, prefix="A", grads=[], more=[more]))
    np.testing.assert_array_equal(await tables[0].numpy(), before)
