"""Optimizers run on the ps and match Keras' formulas (independent numpy reference)."""

from __future__ import annotations

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._formats.messages.operations import (
    MORE_STEPS,
    ApplyGradients,
    ListVariables,
    OptimizerStep,
    ReadVariables,
)
from pstrain._formats.messages.records import OptimizerRule
from pstrain.errors import InvalidArgumentError
from pstrain.partitioners import FixedShardsPartitioner
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(60)


class Reference:
    """Keras' update rules written out plainly; sparse rows update only their slots."""

    def __init__(self, kind, cfg, var, lr_at=None):
        self.kind, self.cfg, self.var, self.t = kind, cfg, np.array(var, np.float64), 0
        self.lr_at = lr_at or (lambda step: cfg["learning_rate"])
        init = cfg.get("initial_accumulator_value", 0.1)
        self.s = {
            "m": np.zeros_like(self.var),
            "v": np.zeros_like(self.var),
            "acc": np.full_like(self.var, init),
            "lin": np.zeros_like(self.var),
            "rms": np.zeros_like(self.var),
            "mom": np.zeros_like(self.var),
            "mg": np.zeros_like(self.var),
            "v_hat": np.zeros_like(self.var),
        }

    def step(self, g, rows=None):
        self.t += 1
        c, s = self.cfg, self.s
        sel = ... if rows is None else rows
        if rows is not None:
            u, inv = np.unique(rows, return_inverse=True)
            summed = np.zeros((u.size,) + g.shape[1:])
            np.add.at(summed, inv, g)
            sel, g = u, summed
        w = self.var[sel]
        lr = self.lr_at(self.t - 1)  # Keras: the rate at iterations before this step
        if self.kind == "sgd":
            mom = c.get("momentum", 0.0)
            if mom:
                m = mom * s["m"][sel] - lr * g
                s["m"][sel] = m
                w = w + (mom * m - lr * g if c.get("nesterov") else m)
            else:
                w = w - lr * g
        elif self.kind == "adagrad":
            acc = s["acc"][sel] + g * g
            s["acc"][sel] = acc
            w = w - lr * g / np.sqrt(acc + c.get("epsilon", 1e-7))
        elif self.kind == "rowwise_adagrad":  # TorchRec's (fbgemm's EXACT_ROWWISE_ADAGRAD)
            squares = g * g
            mean_sq = (
                squares.reshape(squares.shape[0], -1)
                .mean(1)
                .reshape(squares.shape[:1] + (1,) * (squares.ndim - 1))
                if squares.ndim
                else squares
            )
            acc = s["acc"][sel] + mean_sq  # every column of a row holds the row's accumulator
            s["acc"][sel] = acc
            w = w - lr * g / (np.sqrt(acc) + c.get("epsilon", 1e-8))
        elif self.kind == "rmsprop":
            rho, eps = c.get("rho", 0.9), c.get("epsilon", 1e-7)
            rms = rho * s["rms"][sel] + (1 - rho) * g * g
            s["rms"][sel] = rms
            denom = rms
            if c.get("centered"):
                mg = rho * s["mg"][sel] + (1 - rho) * g
                s["mg"][sel] = mg
                denom = rms - mg * mg
            if c.get("momentum"):
                mom = c["momentum"] * s["mom"][sel] + lr * g / np.sqrt(denom + eps)
                s["mom"][sel] = mom
                w = w - mom
            else:  # Keras' epsilon is inside the root here too
                w = w - lr * g / np.sqrt(denom + eps)
        elif self.kind in ("adam", "adamw"):
            if self.kind == "adamw":
                w = w - lr * c.get("weight_decay", 0.004) * w
            b1, b2, eps = c.get("beta_1", 0.9), c.get("beta_2", 0.999), c.get("epsilon", 1e-7)
            m = s["m"][sel] + (g - s["m"][sel]) * (1 - b1)
            v = s["v"][sel] + (g * g - s["v"][sel]) * (1 - b2)
            s["m"][sel], s["v"][sel] = m, v
            if c.get("amsgrad"):  # the largest second moment so far
                v = np.maximum(s["v_hat"][sel], v)
                s["v_hat"][sel] = v
            alpha = lr * np.sqrt(1 - b2**self.t) / (1 - b1**self.t)
            w = w - alpha * m / (np.sqrt(v) + eps)
        elif self.kind == "ftrl":
            p = c.get("learning_rate_power", -0.5)
            l1, l2 = c.get("l1_regularization_strength", 0.0), c.get("l2_regularization_strength", 0.0)
            acc, lin = s["acc"][sel], s["lin"][sel]
            new_acc = acc + g * g
            lin = lin + g - (new_acc**-p - acc**-p) / lr * w
            quad = new_acc**-p / lr + 2 * l2
            w = (np.clip(lin, -l1, l1) - lin) / quad
            s["acc"][sel], s["lin"][sel] = new_acc, lin
        self.var[sel] = w


CASES = [
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1}),
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9}),
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("adagrad", pstrain.optimizers.Adagrad, {"learning_rate": 0.05, "initial_accumulator_value": 0.1}),
    (
        "rowwise_adagrad",
        pstrain.optimizers.RowWiseAdagrad,
        {"learning_rate": 0.05, "initial_accumulator_value": 0.1},
    ),
    ("adam", pstrain.optimizers.Adam, {"learning_rate": 0.01}),
    ("adam", pstrain.optimizers.Adam, {"learning_rate": 0.01, "amsgrad": True}),
    (
        "ftrl",
        pstrain.optimizers.Ftrl,
        {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02},
    ),
    ("rmsprop", pstrain.optimizers.RMSprop, {"learning_rate": 0.01}),
    (
        "rmsprop",
        pstrain.optimizers.RMSprop,
        {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5, "centered": True},
    ),
    ("adamw", pstrain.optimizers.AdamW, {"learning_rate": 0.01, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("kind, cls, cfg", CASES, ids=lambda x: str(x) if isinstance(x, str) else "")
async def test_scalar_variables(ps_server, kind, cls, cfg):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        b = pstrain.Variable(np.float64(0.5))
        opt = cls(**cfg)
    ref = Reference(kind, cfg, np.float64(0.5))
    for g in (0.3, -1.2, 0.7):
        await opt.apply_gradients([(np.float64(g), b)])
        ref.step(np.float64(g))
    np.testing.assert_allclose(await b.numpy(), ref.var, rtol=1e-6)


schedules = pstrain.optimizers.schedules
#: (schedule, the same schedule written out independently)
SCHEDULES = [
    (schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5), lambda step: 0.1 * 0.5 ** (step / 2)),
    (
        schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5, staircase=True),
        lambda step: 0.1 * 0.5 ** (step // 2),
    ),
    (
        schedules.PiecewiseConstantDecay([1, 3], [0.1, 0.05, 0.01]),
        lambda step: 0.1 if step <= 1 else 0.05 if step <= 3 else 0.01,
    ),
    (
        schedules.CosineDecay(0.1, decay_steps=4, alpha=0.2),
        lambda step: 0.1 * (0.8 * 0.5 * (1 + np.cos(np.pi * min(step, 4) / 4)) + 0.2),
    ),
    (  # a warm-up from 0.01 to 0.1 over 2 steps, then the cosine to 0 over 3
        schedules.CosineDecay(0.01, decay_steps=3, warmup_target=0.1, warmup_steps=2),
        lambda step: 0.01 + 0.045 * step if step < 2 else 0.05 * (1 + np.cos(np.pi * min(step - 2, 3) / 3)),
    ),
    (schedules.InverseTimeDecay(0.1, decay_steps=2, decay_rate=0.5), lambda step: 0.1 / (1 + 0.25 * step)),
    (
        schedules.PolynomialDecay(0.1, decay_steps=4, end_learning_rate=0.02, power=2.0),
        lambda step: 0.08 * (1 - min(step, 4) / 4) ** 2 + 0.02,
    ),
    (  # restarts every 2 steps (t_mul 1), each half as high
        schedules.CosineDecayRestarts(0.1, first_decay_steps=2, t_mul=1.0, m_mul=0.5),
        lambda step: 0.1 * 0.5 ** (step // 2) * 0.5 * (1 + np.cos(np.pi * (step % 2) / 2)),
    ),
]


@pytest.mark.parametrize(
    "kind, cls",
    [
        ("sgd", pstrain.optimizers.SGD),
        ("adam", pstrain.optimizers.Adam),
        ("rmsprop", pstrain.optimizers.RMSprop),
    ],
)
@pytest.mark.parametrize("schedule, reference", SCHEDULES)
async def test_learning_rate_schedules_are_evaluated_on_the_ps_from_iterations(
    ps_pair, kind, cls, schedule, reference
):
    rng = np.random.default_rng(1)
    spec = {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )
    w0 = rng.standard_normal((6, 3))
    async with strategy.scope():
        w = pstrain.Variable(w0.copy())  # two parts on two ps: both must use the same step
        opt = cls(learning_rate=schedule)
    ref = Reference(kind, {}, w0, lr_at=reference)
    for _ in range(7):
        g = rng.standard_normal((6, 3))
        await opt.apply_gradients([(g, w)])
        ref.step(g)
    np.testing.assert_allclose(await w.numpy(), ref.var, rtol=1e-6, atol=1e-12)
    assert [round(schedule(s), 12) for s in range(7)] == [round(float(reference(s)), 12) for s in range(7)]


def test_schedules_refuse_bad_parameters():
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="1 less than"):
        schedules.PiecewiseConstantDecay([1, 2], [0.1])
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="decay_steps"):
        schedules.ExponentialDecay(0.1, decay_steps=0, decay_rate=0.5)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="positive number or a"):
        pstrain.optimizers.SGD(learning_rate="fast")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda o: o.Adagrad(float("nan")), "learning_rate must be a positive number"),
        (lambda o: o.SGD(float("inf")), "learning_rate must be a positive number"),
        (
            lambda o: o.Adagrad(0.1, initial_accumulator_value=-1),
            "initial_accumulator_value must be a finite number of 0 or more, got -1",
        ),
        (lambda o: o.Adagrad(0.1, epsilon=float("nan")), "epsilon must be a finite number of 0 or more"),
        (lambda o: o.Adam(0.1, beta_1=1.0), r"beta_1 must be in \[0, 1\), got 1.0"),
        (lambda o: o.Adam(0.1, beta_2=-0.5), r"beta_2 must be in \[0, 1\)"),
        (
            lambda o: o.AdamW(0.1, weight_decay=float("nan")),
            "weight_decay must be a finite number of 0 or more",
        ),
        (lambda o: o.Adam(0.1, epsilon=-1e-7), "epsilon must be a finite number of 0 or more"),
        (lambda o: o.Ftrl(0.1, l1_regularization_strength=-1), "l1_regularization_strength must be"),
        (lambda o: o.Ftrl(0.1, initial_accumulator_value=-0.1), "initial_accumulator_value must be"),
    ],
)
def test_optimizers_refuse_hyper_parameters_that_cannot_train(make, message):
    """Refused when made (a NaN learning rate, a negative accumulator, beta 1: Adam's bias
    correction divides by 1 - beta**t), as TF refuses what it checks, not at the first step."""
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=message):
        make(pstrain.optimizers)
    assert pstrain.schedules.ExponentialDecay is schedules.ExponentialDecay  # import pstrain is enough


@pytest.mark.parametrize("how", ["clipnorm", "clipvalue", "global_clipnorm"])
async def test_clipped_gradients_change_the_variables_as_the_clip_says(ps_pair, how):
    """The worker clips before it sends, as Keras clips what apply_gradients is given: a
    sharded variable's whole gradient is one gradient, a dynamic table's sparse one keeps
    its repeated ids through the clip, and the global norm spans both."""
    strategy = strategy_for(*ps_pair, shards=2)
    async with strategy.scope():
        w = pstrain.Variable(np.zeros((4, 3), np.float32), name="w")  # two parts
        table = pstrain.DynamicEmbedding(2, name="emb", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0, **{how: 2.0})
    await table.lookup(np.array([7, 9]))  # the rows exist, at 0
    g = np.arange(12, dtype=np.float32).reshape(4, 3) / 4  # norm about 3.25
    sparse = pstrain.IndexedSlices(np.array([[3, 4], [3, 4], [0, 1]], np.float32), np.array([7, 7, 9]))
    await opt.apply_gradients([(g, w), (sparse, table)])
    values = sparse.values
    if how == "clipnorm":
        want_w = g * 2 / np.linalg.norm(g)
        values = values * 2 / np.sqrt(51)  # the values' norm, the repeated row twice
    elif how == "clipvalue":
        want_w, values = np.clip(g, -2, 2), np.clip(values, -2, 2)
    else:
        scale = 2 / np.sqrt(np.sum(g * g) + 51)
        want_w, values = g * scale, values * scale
    np.testing.assert_allclose(await w.numpy(), -want_w, rtol=1e-5)
    rows = await table.lookup(np.array([7, 9]), training=False)
    np.testing.assert_allclose(rows, -np.stack([values[0] + values[1], values[2]]), rtol=1e-5)


@pytest.mark.parametrize("cls", [pstrain.optimizers.SGD, pstrain.optimizers.Adagrad, pstrain.optimizers.Adam])
async def test_weight_decay_of_any_optimizer_decays_a_dense_variable_and_a_sparse_gradients_rows(
    ps_pair, cls
):
    """Keras 3's ``weight_decay`` on every optimizer, applied on the ps before the rule: a
    dense variable all of it, a sparse gradient's rows only (as AdamW), a dynamic table's rows."""
    strategy = strategy_for(*ps_pair, shards=2)
    async with strategy.scope():
        w = pstrain.Variable(np.ones((4, 2), np.float32), name="w")
        table = pstrain.DynamicEmbedding(2, name="emb", initializer=pstrain.initializers.Constant(1.0))
        decayed = cls(0.1, weight_decay=0.5, name="decayed")
        plain = cls(0.1, name="plain")
    await table.lookup(np.array([3, 8]))
    zero = np.zeros((4, 2), np.float32)
    await decayed.apply_gradients([(pstrain.IndexedSlices(zero[:1], [2]), w)])
    await decayed.apply_gradients([(pstrain.IndexedSlices(np.zeros((1, 2), np.float32), [8]), table)])
    want = np.ones((4, 2), np.float32)
    want[2] = 0.95  # 1 - 0.1 * 0.5, the zero gradient's step nothing
    np.testing.assert_allclose(await w.numpy(), want, rtol=1e-6)
    rows = await table.lookup(np.array([3, 8]), training=False)
    np.testing.assert_allclose(rows, [[1.0, 1.0], [0.95, 0.95]], rtol=1e-6)
    await decayed.apply_gradients([(zero, w)])
    np.testing.assert_allclose(await w.numpy(), want * 0.95, rtol=1e-6)
    await plain.apply_gradients([(zero, w)])  # no decay: a zero gradient moves nothing
    np.testing.assert_allclose(await w.numpy(), want * 0.95, rtol=1e-6)


def test_an_ftrl_optimizer_keeps_its_name():
    """(Its argument check reused ``name``: every Ftrl was named l2_regularization_strength.)"""
    assert pstrain.optimizers.Ftrl(0.1, name="ranker").name == "ranker"
    assert pstrain.optimizers.Ftrl(0.1).name.startswith("Ftrl")


async def test_per_part_gradients_of_a_sharded_variable(ps_pair):
    """TF's pattern: gradients for ``model.trainable_variables`` (the parts), not the whole."""
    rng = np.random.default_rng(2)
    spec = {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )
    e0 = rng.standard_normal((8, 2))
    model = pstrain.Module()
    async with strategy.scope():
        model.table = pstrain.Variable(e0.copy())
        opt = pstrain.optimizers.Adagrad(0.1)
    parts = model.trainable_variables
    assert len(parts) == 2 and [p.shape for p in parts] == [(4, 2), (4, 2)]
    ref = Reference("adagrad", {"learning_rate": 0.1}, e0)
    for _ in range(3):
        g = rng.standard_normal((8, 2))
        grads = [g[:4], pstrain.IndexedSlices(g[4:][[0, 3]], [0, 3])]  # dense part, sparse part
        await opt.apply_gradients(zip(grads, parts))
        full = g.copy()
        full[[5, 6]] = 0
        ref_rows = np.r_[0:4, 4, 7]
        ref.step(full[ref_rows], ref_rows)
    np.testing.assert_allclose(await model.table.numpy(), ref.var, rtol=1e-6)


@pytest.mark.parametrize("kind, cls, cfg", CASES, ids=lambda x: str(x) if isinstance(x, str) else "")
async def test_dense_and_sparse_steps_match_the_reference(ps_pair, kind, cls, cfg):
    rng = np.random.default_rng(0)
    spec = {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )
    w0 = rng.standard_normal((6, 3))
    e0 = rng.standard_normal((9, 4))
    async with strategy.scope():
        w = pstrain.Variable(w0.copy(), name="w")  # float64, sharded in 2
        table = pstrain.Variable(e0.copy(), name="table")  # sharded in 2
        opt = cls(**cfg)
    ref_w, ref_t = Reference(kind, cfg, w0), Reference(kind, cfg, e0)
    for step in range(5):
        g = rng.standard_normal((6, 3))
        rows = rng.integers(0, 9, size=7)  # duplicates on purpose
        vals = rng.standard_normal((7, 4))
        it = await opt.apply_gradients([(g, w), (pstrain.IndexedSlices(vals, rows), table)])
        assert it == step + 1
        ref_w.step(g)
        ref_t.step(vals, rows)
    np.testing.assert_allclose(await w.numpy(), ref_w.var, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(await table.numpy(), ref_t.var, rtol=1e-6, atol=1e-12)
    assert await opt.iterations.numpy() == 5


async def test_apply_gradients_given_no_pairs_says_so_and_applies_nothing(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.ones(3, np.float32), name="v")
        opt = pstrain.optimizers.SGD(0.5)
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match=r"apply_gradients takes \(gradient, variable\) pairs"
    ):
        await opt.apply_gradients([(np.ones(3, np.float32), v), v])  # the second is no pair
    assert (await v.numpy()).tolist() == [1, 1, 1] and await opt.iterations.numpy() == 0
    assert await opt.apply_gradients([(np.ones(3, np.float32), v)]) == 1
    assert (await v.numpy()).tolist() == [0.5, 0.5, 0.5]


async def test_gradients_of_none_are_skipped_with_a_warning_and_all_none_is_refused(ps_server, caplog):
    """As Keras: a variable whose gradient is None is left as it is, with a warning naming
    it; a step where every gradient is None (or none is given) is refused, nothing counted."""
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.ones(3, np.float32), name="v")
        w = pstrain.Variable(np.ones(2, np.float32), name="w")
        opt = pstrain.optimizers.SGD(0.5)
    for pairs in ([(None, v), (None, w)], []):
        with pytest.raises(
            pstrain.errors.InvalidArgumentError, match=r"No gradients provided for any variable"
        ):
            await opt.apply_gradients(pairs)
    assert await opt.iterations.numpy() == 0
    with caplog.at_level("WARNING", logger="pstrain.optimizers"):
        assert await opt.apply_gradients([(np.ones(3, np.float32), v), (None, w)]) == 1
    assert "Gradients do not exist for variables ['w']" in caplog.text
    assert (await v.numpy()).tolist() == [0.5, 0.5, 0.5] and (await w.numpy()).tolist() == [1, 1]


async def test_a_variable_given_twice_is_updated_twice_in_one_step_as_keras_does(ps_pair):
    """As Keras: ``apply_gradients`` given a variable twice applies both gradients, one after
    the other, in one step (``iterations`` counts one). The figures are TensorFlow 2.21's
    (``tf.keras.optimizers.Adagrad(0.1)``, SGD(0.1)) for the same calls; a sharded variable's
    parts, each given twice, and a table, too."""
    spec = {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )
    async with strategy.scope():
        v = pstrain.Variable(np.array([1.0, 2.0], np.float32), name="v")
        emb = pstrain.Variable(np.ones((4, 2), np.float32), name="emb")  # sharded in 2
        table = pstrain.DynamicEmbedding(2, name="t")
        adagrad, sgd = pstrain.optimizers.Adagrad(0.1), pstrain.optimizers.SGD(0.1)
    assert await adagrad.apply_gradients([(np.array([1.0, 1.0]), v), (np.array([2.0, 2.0]), v)]) == 1
    np.testing.assert_allclose(await v.numpy(), [0.81609225, 1.8160923], rtol=1e-6)
    two = np.ones((2, 2), np.float32)
    await sgd.apply_gradients(  # each part given twice; row 0 in both
        [(pstrain.IndexedSlices(two, [0, 2]), emb), (pstrain.IndexedSlices(two, [0, 3]), emb)]
    )
    np.testing.assert_allclose(await emb.numpy(), [[0.8, 0.8], [1, 1], [0.9, 0.9], [0.9, 0.9]], rtol=1e-6)
    ids = np.array([5, 6], np.int64)
    before = await table.lookup(ids)
    await sgd.apply_gradients(
        [
            (pstrain.IndexedSlices(np.ones((2, 2)), ids), table),
            (pstrain.IndexedSlices(np.ones((2, 2)), ids), table),
        ]
    )
    np.testing.assert_allclose(await table.lookup(ids, training=False), before - 0.2, rtol=1e-6)
    assert await sgd.iterations.numpy() == 2


async def test_slots_stay_on_the_ps_and_untouched_rows_do_not_move(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        table = pstrain.Variable(np.ones((1000, 8), np.float32), name="emb")
        opt = pstrain.optimizers.Adam(0.1)
    await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((2, 8)), [3, 3]), table)])
    value = await table.numpy()
    assert (value[3] < 1).all() and (np.delete(value, 3, axis=0) == 1).all()
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    names = {v.name for v in (await ch.request(ListVariables())).variables}
    assert {opt.slot_variable_name(table, "m"), opt.slot_variable_name(table, "v")} <= names
    stats = (await ch.statistics())["requests"]["opt/apply"]
    assert stats["bytes_out"] < 1000  # nothing but a small acknowledgement comes back
    m = (await ch.request(ReadVariables(names=[opt.slot_variable_name(table, "m")]))).values[0]
    assert (m[3] != 0).all() and (np.delete(m, 3, axis=0) == 0).all()
    await ch.close()


async def test_apply_gradients_one_request_per_ps(ps_pair):
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        vs = [pstrain.Variable(np.zeros(4, np.float32), name=f"v{i}") for i in range(4)]
        opt = pstrain.optimizers.SGD(1.0)
    channels = [rpc.Channel(s.address, token=TOKEN, task=f"ps{i}") for i, s in enumerate(ps_pair)]
    await opt.apply_gradients([(np.ones(4), v) for v in vs])
    counts = [(await ch.statistics())["requests"]["opt/apply"]["count"] for ch in channels]
    assert counts == [1, 1]
    assert [(await v.numpy()).tolist() for v in vs] == [[-1.0] * 4] * 4
    for ch in channels:
        await ch.close()


async def test_training_from_workers(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        w = pstrain.Variable(np.zeros(3), name="w")
        opt = pstrain.optimizers.SGD(0.5)
    target = np.array([1.0, -2.0, 3.0])

    async def step():
        value = await w.read_value()
        await opt.apply_gradients([(value - target, w)])  # gradient of 0.5 |w - target|^2

    for _ in range(60):
        coordinator.schedule(step)
    await coordinator.join()
    np.testing.assert_allclose(await w.numpy(), target, atol=1e-3)
    assert await opt.iterations.numpy() == 60
    await coordinator.close()


async def test_optimizers_past_what_one_request_carries_update_in_more_requests(ps_server):
    """``apply_together`` with more optimizers on one ps than one ``opt/apply`` may carry
    (``MORE_STEPS`` besides its own) sends the rest in another request, and every
    optimizer's rule updates its own variable; a request past the limit, sent by hand, is
    refused by name and changes nothing."""
    n = MORE_STEPS + 5
    async with strategy_for(ps_server).scope():
        variables = [pstrain.Variable(np.full(2, float(k), np.float32), name=f"v{k}") for k in range(n)]
        optimizers = [pstrain.optimizers.SGD(0.5 + k) for k in range(n)]
    steps = [(opt, [(np.ones(2, np.float32), v)]) for opt, v in zip(optimizers, variables)]
    with pstrain.count_requests() as updates:
        counted = await pstrain.optimizers.apply_together(steps)
    assert counted == [1] * n
    assert updates.per_op == {"opt/apply": 2}, updates.per_op
    for k, v in enumerate(variables):
        np.testing.assert_array_equal(await v.numpy(), np.full(2, k - (0.5 + k), np.float32))
    rule = OptimizerRule(kind="sgd", learning_rate=1.0)
    one = OptimizerStep(rule=rule, prefix="p", grads=[[variables[0].key, None, np.ones(2, np.float32)]])
    too_many = ApplyGradients(rule=rule, prefix="p", grads=[], more=[one] * (MORE_STEPS + 1))
    with pytest.raises(InvalidArgumentError, match="more"):
        await variables[0].channel().request(too_many)
    np.testing.assert_array_equal(await variables[0].numpy(), np.full(2, -0.5, np.float32))


async def test_optimizers_that_need_the_step_keep_their_counters_on_one_ps_unless_colocated(ps_pair):
    """The step counters of optimizers that need the step (Adam's, a schedule's) are made on
    the first one's ps, so a step of several counts them in one request; one made inside
    ``colocate_vars_with`` goes where the caller says, and an SGD's goes in turn."""
    strategy = strategy_for(*ps_pair)
    with strategy.scope():
        first = pstrain.optimizers.Adam(0.1)
        others = [
            pstrain.optimizers.Adam(0.1),
            pstrain.optimizers.SGD(pstrain.schedules.ExponentialDecay(0.5, 1, 0.5)),
        ]
        plain = [pstrain.optimizers.SGD(0.1) for _ in range(2)]
        elsewhere = pstrain.Variable(np.zeros(1, np.float32))
        if elsewhere.ps_index == first.iterations.ps_index:
            elsewhere = pstrain.Variable(np.zeros(1, np.float32))
        with strategy.extended.colocate_vars_with(elsewhere):
            colocated = pstrain.optimizers.Adam(0.1)
    home = first.iterations.ps_index
    assert [o.iterations.ps_index for o in others] == [home, home]
    assert {o.iterations.ps_index for o in plain} == {0, 1}  # in turn, as any variable
    assert elsewhere.ps_index != home and colocated.iterations.ps_index == elsewhere.ps_index
