"""A rerun of an exactly-once closure whose dead attempt applied part of its updates ends
in the state of a run without the fault: it reads what the first attempt read
(``pstrain/server/ps/before_images.py``), so the updates left to apply are the ones the
first attempt would have applied.

Found by the fault matrix (``tests/system/test_fault_matrix.py``): a worker cut off while its
step's ``opt/apply`` had reached one ps and not the other; the rerun read the changed
half, and every variable ended a little off the run without faults.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pstrain
from pstrain._base.tags import set_dispatch
from pstrain._formats.messages.operations import ScatterAdd, Update, UpdateKind, UpdateVariables
from pstrain._training.optimizers import apply_together
from pstrain._variables.batched import read_variables
from pstrain.server.ps.before_images import BeforeImages
from pstrain.server.ps.store import VariableRecord, VariableStore
from tests.helpers import strategy_for

pytestmark = pytest.mark.timeout(120)


async def _train_step(model, opt, table, ids, only_ps=None):
    """One step of a tiny model (a dense variable on each ps, an embedding variable read and
    changed by rows, a dynamic table on both ps): reads, computes the gradients from what it
    read, applies them; ``only_ps``: send only the gradients of that ps (an attempt whose
    other request never arrived)."""
    w, v, e = model
    rows = await table.lookup(ids)
    vw, vv = await read_variables([w, v])
    erows = np.unique(ids % e.shape[0])
    ve = await e.sparse_read(erows)
    x = rows.sum(axis=0)
    grads = [
        (vw * 0.5 + x[: vw.size], w),
        (vv * vv - 0.25 + x[: vv.size], v),
        (pstrain.IndexedSlices(ve * vw[0] + x, erows), e),
        (pstrain.IndexedSlices(rows * vw.sum() + ve.sum(), ids), table),
    ]
    if only_ps is not None:
        kept = [(g, var) for g, var in grads[:3] if var.ps_index == only_ps]
        groups = [
            (i, vals) for ps, i, vals in table.gradient_groups(ids, grads[3][0].values) if ps == only_ps
        ]
        grads = kept + [(pstrain.IndexedSlices(vals, i), table) for i, vals in groups]
    if isinstance(opt, tuple):  # the dense variables' optimizer and the rows' (one request per ps)
        dense = [(g, var) for g, var in grads if var is w or var is v]
        rows = [(g, var) for g, var in grads if var is not w and var is not v]
        await apply_together([(opt[0], dense), (opt[1], rows)])
    else:
        await opt.apply_gradients(grads)


async def _model(strategy, name, optimizer):
    async with strategy.scope():
        w = pstrain.Variable(np.linspace(-1, 1, 4, dtype=np.float32), name=f"{name}/w")
        v = pstrain.Variable(np.full(3, 0.5, np.float32), name=f"{name}/v")
        e = pstrain.Variable(np.linspace(0, 1, 40 * 4, dtype=np.float32).reshape(40, 4), name=f"{name}/e")
        table = pstrain.DynamicEmbedding(
            4, name=f"{name}/t", initializer=pstrain.initializers.RandomUniform(-0.1, 0.1, seed=7)
        )
        adam = pstrain.optimizers.Adam(0.05, name=f"{name}/opt")
        adagrad = pstrain.optimizers.Adagrad(learning_rate=0.1, name=f"{name}/rows")
    opt = {"adam": adam, "adagrad": adagrad, "adam and adagrad": (adam, adagrad)}[optimizer]
    return (w, v, e), opt, table


async def _state(model, opt, table, ids):
    counters = [o.iterations for o in (opt if isinstance(opt, tuple) else (opt,))]
    values = await read_variables([*model, *counters])
    return [*values, await table.lookup(ids, training=False)]


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "adam and adagrad"])
async def test_an_apply_that_reached_one_ps_of_two_is_finished_as_the_first_attempt_computed(
    ps_pair, optimizer
):
    """In-process: the first attempt's ``opt/apply`` reaches ps0 only; its rerun reads (rows
    from the table, the variables, rows of one), computes and applies. The state is the one a run
    without the fault ends in, step after step."""
    strategy = strategy_for(*ps_pair)
    ids = np.array([3, 8, 11, 20, 21, 40], np.int64)
    # (Adam counts the step first, with the counter's ps's gradients: its bias correction
    # needs it; a rerun that finds it counted applies the rest at that step)
    want_m, want_opt, want_t = await _model(strategy, "want", optimizer)
    got_m, got_opt, got_t = await _model(strategy, "got", optimizer)
    assert {want_m[0].ps_index, want_m[1].ps_index} == {0, 1}
    assert want_m[2].ps_index == 0  # its rows change in the update that arrives
    for step in range(3):
        await _train_step(want_m, want_opt, want_t, ids + step)
        key = f"closure-{step}"
        set_dispatch(None, key)  # the first attempt: only ps0 gets its update
        try:
            await _train_step(got_m, got_opt, got_t, ids + step, only_ps=0)
            set_dispatch(None, key)  # the rerun (another attempt of the same closure)
            await _train_step(got_m, got_opt, got_t, ids + step)
        finally:
            set_dispatch(None, None)
        want = await _state(want_m, want_opt, want_t, ids + step)
        got = await _state(got_m, got_opt, got_t, ids + step)
        for w_, g_ in zip(want, got):
            np.testing.assert_array_equal(g_, w_, err_msg=f"step {step}")


async def test_a_later_update_of_another_closure_drops_the_before_image(ps_pair):
    """The image is of the latest exactly-once closure only: once another update changed
    the variable, a late rerun of the first reads the current values. (Every attempt runs
    the same operations: a read, an update, a read.)"""
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        a = pstrain.Variable(np.zeros(2), name="a")

    async def attempt():
        before = await a.numpy()
        await a.assign_add(np.ones(2))
        return before, await a.numpy()

    try:
        set_dispatch(None, "first")
        assert [list(x) for x in await attempt()] == [[0, 0], [1, 1]]
        set_dispatch(None, "first")  # a rerun, nothing else changed a: it reads what the first did
        assert [list(x) for x in await attempt()] == [[0, 0], [1, 1]]  # (its update skipped)
        set_dispatch(None, None)
        await a.assign_add(np.ones(2))  # outside any closure: the image goes
        set_dispatch(None, "first")  # a late rerun reads a as it is
        assert [list(x) for x in await attempt()] == [[2, 2], [2, 2]]
    finally:
        set_dispatch(None, None)
    np.testing.assert_array_equal(await a.numpy(), [2.0, 2.0])
    # the ps says what it keeps: the image of the late rerun's (skipped) update is gone
    # with it; the statistics name what is kept, and its size
    stats = await a.channel().statistics()
    assert stats.get("before_images", {"count": 0})["count"] == 0, stats
    set_dispatch(None, "third")
    try:
        await a.assign_add(np.ones(2))
    finally:
        set_dispatch(None, None)
    stats = await a.channel().statistics()
    assert stats["before_images"] == {"count": 1, "bytes": 16}, stats


# -- the images on their own, against a model: any run of closures, updates and reads ---------
_ROWS = 6


def _apply(store, images, key, seq, rows, delta):
    """One update of variable ``v`` (rows, or all of it when ``rows`` is None), as a ps
    applies it behind its fence: the image taken before, kept after."""
    update = (
        Update(op=UpdateKind.ASSIGN_ADD, name="v", value=delta)
        if rows is None
        else Update(op=UpdateKind.SCATTER_ADD, name="v", indices=rows, values=delta)
    )
    req = UpdateVariables(updates=[update], once=(key, seq) if key is not None else None)
    then = images.capture(req.once, req)
    arr = store.get("v").writable(None if rows is None else rows)
    if rows is None:
        arr += delta
    else:
        np.add.at(arr, rows, delta)
    if then is not None:
        then()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["A", "B", "C", None]),
            st.lists(
                st.one_of(st.none(), st.lists(st.integers(0, _ROWS - 1), min_size=1, max_size=4)),
                min_size=1,
                max_size=3,
            ),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_rerun_reads_the_values_from_before_its_closure_whatever_ran_before(runs):
    """Closures (a key, or None: code outside exactly-once closures) run one after another,
    each some updates of one variable (whole, or rows); some pin the array between (a
    reply in flight). After each, a rerun of the latest closure reads, before its first
    update, the values from before that closure ran; a rerun of any earlier one, and a
    read past the first update, the values as they are."""
    store = VariableStore("/job:ps/replica:0/task:0")
    store.add([VariableRecord("v", np.zeros((_ROWS, 2)), True)])
    images = BeforeImages(store, {})
    rng = np.random.default_rng(0)
    for i, (key, updates, pin) in enumerate(runs):
        key = None if key is None else f"{key}{i}"  # each run a closure of its own
        before = store.get("v").array.copy()
        for seq, rows in enumerate(updates, start=1):
            if pin:
                store.get("v").pin()
            shape = (_ROWS, 2) if rows is None else (len(rows), 2)
            _apply(
                store,
                images,
                key,
                seq,
                None if rows is None else np.array(rows),
                rng.integers(1, 9, shape).astype(np.float64),
            )
        now = store.get("v").array
        read = images.whole("v", [key, 0], now) if key is not None else now
        np.testing.assert_array_equal(read, before if key is not None else now)
        idx = np.array([0, _ROWS - 1, 2])
        if key is not None:
            np.testing.assert_array_equal(images.rows("v", [key, 0], idx, now[idx]), before[idx])
            np.testing.assert_array_equal(images.whole("v", [key, 1], now), now)  # past it
        for earlier in range(i):
            for k in "ABC":
                np.testing.assert_array_equal(images.whole("v", [f"{k}{earlier}", 0], now), now)


async def test_a_bad_update_of_an_exactly_once_closure_is_refused_by_name_and_changes_nothing(ps_pair):
    """Rows out of range, and rows of a scalar, sent by an exactly-once closure: the ps's
    error names them, the variable is as it was, and a rerun reads it as it is."""
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        m = pstrain.Variable(np.zeros((3, 2)), name="m")
        s = pstrain.Variable(0.0, name="s")
    try:
        set_dispatch(None, "bad")
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="out of range|rows"):
            await m.channel().request(ScatterAdd(name="m", indices=np.array([1, 7]), values=np.ones((2, 2))))
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="'s'"):
            await s.channel().request(ScatterAdd(name="s", indices=np.array([0]), values=np.ones(1)))
        set_dispatch(None, "bad")
        np.testing.assert_array_equal(await m.numpy(), np.zeros((3, 2)))
        assert await s.numpy() == 0.0
    finally:
        set_dispatch(None, None)


def test_the_images_of_variables_that_left_the_ps_are_swept_away():
    store = VariableStore("/job:ps/replica:0/task:0")
    store.add([VariableRecord("v", np.zeros((4, 2)), True), VariableRecord("w", np.zeros(3), True)])
    images = BeforeImages(store, {})
    _apply(store, images, "k", 1, np.array([1, 2]), np.ones((2, 2)))
    req = UpdateVariables(
        updates=[Update(op=UpdateKind.ASSIGN_ADD, name="w", value=np.ones(3))], once=("k", 2)
    )
    images.capture(req.once, req)()
    assert len(images) == 2 and images.nbytes > 0
    store.delete(["v"])  # moved away, say
    images.sweep()
    assert len(images) == 1
    np.testing.assert_array_equal(images.whole("w", ["k", 0], np.ones(3)), np.zeros(3))
