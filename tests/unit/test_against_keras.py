"""Keras' learning-rate schedules and gradient clipping against Keras' own numbers
(``references/make_references.py keras_schedules`` and ``keras_clipping`` made the files
with Keras 3 and TensorFlow; pstrain does not need either)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain import IndexedSlices
from pstrain._training.clipping import Clipping

from .test_pooled_lookups_against_frameworks import cases, dense_gradient

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REFERENCES = Path(__file__).resolve().parent / "references"
SCHEDULES = json.loads((REFERENCES / "keras_schedules.json").read_text())


@pytest.mark.parametrize(
    "case", SCHEDULES["cases"], ids=[f"{c['name']}-{i}" for i, c in enumerate(SCHEDULES["cases"])]
)
def test_schedules_give_keras_rates(case):
    schedule = getattr(pstrain.schedules, case["name"])(**case["kwargs"])
    got = [schedule(step) for step in SCHEDULES["steps"]]
    np.testing.assert_allclose(got, case["rates"], rtol=1e-5, atol=1e-7)  # Keras: float32
    again = pstrain.schedules.from_spec(schedule.spec())  # as the ps rebuilds it
    assert [again(step) for step in SCHEDULES["steps"]] == got


def test_each_clipping_gives_what_keras_subtracts():
    """``SGD(1.0, clipnorm=...)`` and the others, against what Keras' SGD subtracted: two
    dense gradients and a sparse one whose rows repeat (Keras takes its norm, and clips its
    values, before the repeated rows are summed)."""
    _, all_cases = cases("keras_clipping.npz")
    kinds = ("clipnorm", "clipvalue", "global_clipnorm")
    seen = set()
    for case in all_cases:
        kind, limit = kinds[int(case["meta"][0])], float(case["meta"][1])
        grads = [
            case["d0"].reshape(5, 3),
            case["d1"],
            IndexedSlices(case["values"].reshape(5, 2), case["rows"], (6, 2)),
        ]
        clipped = Clipping(**{kind: limit}).clip(grads)
        np.testing.assert_allclose(clipped[0], case["out0"].reshape(5, 3), rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(clipped[1], case["out1"], rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(
            dense_gradient(clipped[2], (6, 2)), case["out2"].reshape(6, 2), rtol=2e-6, atol=1e-7
        )
        changed = not all(
            np.array_equal(np.asarray(getattr(a, "values", a)), np.asarray(getattr(b, "values", b)))
            for a, b in zip(grads, clipped)
        )
        seen.add((kind, changed))
    assert seen == {(k, c) for k in kinds for c in (True, False)}  # every kind both clipped and not


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clipnorm": 1.0, "clipvalue": 1.0}, "Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"),
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, "Only one of"),
        ({"clipnorm": 0.0}, "clipnorm must be a positive number"),
        ({"clipvalue": -1.0}, "clipvalue must be a positive number"),
        ({"global_clipnorm": math.nan}, "global_clipnorm must be a positive number"),
        ({"clipnorm": "1"}, "clipnorm must be a positive number"),
    ],
)
def test_optimizers_refuse_clipping_they_cannot_do(kwargs, message):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=message):
        pstrain.optimizers.Adam(0.1, **kwargs)


def test_a_clipped_optimizer_says_so_in_its_config_but_not_to_the_ps():
    opt = pstrain.optimizers.Adagrad(0.1, global_clipnorm=2.0)
    assert opt.get_config()["global_clipnorm"] == 2.0
    assert "global_clipnorm" not in opt._rule()  # the worker clips; the ps's rule is Adagrad's
    assert "clipnorm" not in pstrain.optimizers.SGD(0.1).get_config()


def test_global_clipping_of_a_non_finite_gradient_gives_nan_as_keras():
    out = Clipping(global_clipnorm=1.0).clip([np.array([np.inf, 1.0], np.float32), np.ones(2, np.float32)])
    assert all(np.isnan(g).all() for g in out)


def test_the_norm_of_float32_values_whose_squares_overflow():
    big = np.full(4, 3e19, np.float32)  # each square past float32's range
    (out,) = Clipping(clipnorm=1.0).clip([big])
    np.testing.assert_allclose(out, np.full(4, 0.5, np.float32), rtol=1e-6)
    assert out.dtype == np.float32


METRICS = json.loads((REFERENCES / "keras_metrics.json").read_text())
#: Keras reduces these over the last axis: a (n,) batch is one value to it, n examples here.
PER_EXAMPLE = {"BinaryCrossentropy", "MeanSquaredError", "MeanAbsoluteError"}


@pytest.mark.parametrize(
    "case",
    [c for c in METRICS["cases"] if c["column"] or c["name"] not in PER_EXAMPLE],
    ids=lambda c: (
        f"{c['name']}-{sorted(c['kwargs'].items())}-{'column' if c['column'] else 'flat'}"
        f"-{'weighted' if c['batches'][0][2] is not None else 'unweighted'}"
    ),
)
async def test_metrics_give_keras_results(case):
    """Three batches into a metric (outside a strategy: the same arithmetic a ps runs),
    against what Keras' metric gave for them."""
    metric = getattr(pstrain.metrics, case["name"])(**case["kwargs"])
    for labels, preds, weights in case["batches"]:
        shape = (-1, 1) if case["column"] else (-1,)
        await metric.update_state(np.reshape(labels, shape), np.reshape(preds, shape), weights)
    assert case["result"] is not None
    np.testing.assert_allclose(await metric.result(), case["result"], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "case",
    METRICS["ranked"],
    ids=lambda c: (
        f"{c['name']}-{sorted(c['kwargs'].items())}-{'weighted' if c['batches'][0][2] else 'unweighted'}"
    ),
)
async def test_precision_and_recall_over_classes_give_keras_results(case):
    """``top_k``, ``class_id`` and both, with and without thresholds, on ``(examples,
    classes)`` batches whose labels are 0, 1, 0.4 or -1 (every label that is not 0 a
    positive, as Keras counts them): Keras' results."""
    metric = getattr(pstrain.metrics, case["name"])(**case["kwargs"])
    for labels, preds, weights in case["batches"]:
        await metric.update_state(np.array(labels), np.array(preds), weights)
    np.testing.assert_allclose(await metric.result(), case["result"], rtol=2e-5, atol=2e-6)


async def test_a_flat_batch_is_as_many_examples_for_the_metrics_keras_reduces_per_row():
    """Keras' BinaryCrossentropy takes a ``(n,)`` batch as one example (and cannot weigh
    it); here it is n examples, the same as ``(n, 1)``: the result Keras gives for columns."""
    cases = [c for c in METRICS["cases"] if c["name"] in PER_EXAMPLE and c["column"]]
    assert len(cases) == 10  # 5 settings, weighted and not
    for case in cases:
        flat = getattr(pstrain.metrics, case["name"])(**case["kwargs"])
        for labels, preds, weights in case["batches"]:
            await flat.update_state(labels, preds, weights)
        np.testing.assert_allclose(await flat.result(), case["result"], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m: m.BinaryAccuracy(threshold=float("nan")), "threshold must be a finite number"),
        (lambda m: m.BinaryCrossentropy(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
        (lambda m: m.Precision(thresholds=1.5), r"thresholds must be numbers in \[0, 1\]"),
        (lambda m: m.Recall(thresholds=[]), "thresholds must be numbers"),
        (lambda m: m.Precision(0.5, "precision"), "top_k must be a positive integer"),  # Keras' order
        (lambda m: m.Recall(top_k=0), "top_k must be a positive integer"),
        (lambda m: m.Recall(class_id=-1), "class_id must be an integer of 0 or more"),
    ],
)
def test_metric_settings_that_measure_nothing_are_refused(make, message):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=message):
        make(pstrain.metrics)


async def test_precision_at_several_thresholds_gives_one_value_each():
    p = pstrain.metrics.Precision(thresholds=[0.2, 0.6])
    await p.update_state([1, 0, 1, 0], [0.3, 0.4, 0.7, 0.9])
    assert await p.result() == [0.5, 0.5]
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="differ"):
        await p.update_state([1, 0], [0.3, 0.4, 0.5])
    by_class = pstrain.metrics.Precision(class_id=3)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=r"class_id=3.*got shape \(2, 3\)"):
        await by_class.update_state(np.ones((2, 3)), np.ones((2, 3)))


OPTIMIZERS = json.loads((REFERENCES / "keras_optimizers.json").read_text())


@pytest.mark.parametrize(
    "case", OPTIMIZERS["cases"], ids=lambda c: f"{c['name']}-{'-'.join(sorted(c['kwargs']))}"
)
def test_optimizer_steps_as_keras(case):
    """Each optimizer's rule as the ps runs it (its settings from the optimizer, as sent),
    three dense steps, a row of them tiny, against the variable Keras' optimizer left;
    with ``weight_decay`` or ``amsgrad``, not what the rule gives without it."""
    from pstrain._formats.numerics.optimizer_rules import RULES, slot_specs

    opt = getattr(pstrain.optimizers, case["name"])(**case["kwargs"])
    cfg = opt._rule()
    var = np.array(case["start"], np.float32)
    slots = {name: np.full_like(var, init) for name, init in slot_specs(cfg).items()}
    for t, g in enumerate(case["grads"], 1):
        RULES[cfg["kind"]](var, np.array(g, np.float32), None, slots, cfg, t)
    np.testing.assert_allclose(var, case["end"], rtol=2e-5, atol=2e-6)
    for setting, off in (("weight_decay", 0.0), ("amsgrad", False)):
        if setting not in case["kwargs"]:
            continue
        without = dict(cfg, **{setting: off})
        plain = np.array(case["start"], np.float32)
        slots = {name: np.full_like(plain, init) for name, init in slot_specs(without).items()}
        for t, g in enumerate(case["grads"], 1):
            RULES[cfg["kind"]](plain, np.array(g, np.float32), None, slots, without, t)
        assert not np.allclose(plain, case["end"], rtol=1e-5, atol=0)  # the setting made it Keras'


@pytest.mark.parametrize(
    "case",
    METRICS["weighted_shapes"],
    ids=lambda c: f"{c['name']}-{np.shape(c['args'][0])}-{np.shape(c['weight'])}",
)
async def test_a_sample_weight_spreads_over_values_of_other_shapes_as_keras_spreads_it(case):
    """A weight per example covers each of its values (aligned from the first axis: numpy's
    broadcasting would weigh the columns of a square batch instead, silently)."""
    metric = getattr(pstrain.metrics, case["name"])()
    await metric.update_state(*[np.array(a) for a in case["args"]], sample_weight=case["weight"])
    np.testing.assert_allclose(await metric.result(), case["result"], rtol=1e-6)


async def test_a_weight_that_fits_no_axis_of_the_values_is_refused():
    m = pstrain.metrics.Mean()
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match=r"sample_weight of shape \(2,\) does not match"
    ):
        await m.update_state(np.ones((3, 2)), sample_weight=np.ones(2))  # (numpy would weigh columns)
    assert await m.result() == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"curve": "ROCX"}, r"curve must be one of \['ROC', 'PR', 'PRGAIN'\]"),
        ({"summation_method": "trapezoid"}, "summation_method must be one of"),
        ({"multi_label": True}, "multi_label is not supported"),
        ({"thresholds": [0.5, 1.5]}, r"thresholds must be numbers in \[0, 1\]"),
        ({"num_thresholds": 1}, "num_thresholds must be > 1"),
    ],
)
def test_an_auc_that_cannot_be_measured_is_refused(kwargs, message):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=message):
        pstrain.metrics.AUC(**kwargs)


async def test_an_auc_of_logits_is_the_auc_of_their_sigmoid_and_curve_names_take_any_case():
    logits = np.array([-3.0, 2.0, 0.5, 1.0, -0.2])
    labels = [0, 1, 1, 0, 1]
    of_logits = pstrain.metrics.AUC(curve="pr", from_logits=True)
    of_probabilities = pstrain.metrics.AUC(curve="PR")
    await of_logits.update_state(labels, logits)
    await of_probabilities.update_state(labels, 1 / (1 + np.exp(-logits)))
    assert of_logits.curve == "PR" and await of_logits.result() == await of_probabilities.result()


def test_a_sparse_amsgrad_step_is_the_dense_one_on_its_rows():
    """The sparse path of AMSGrad (a table's rows) takes the dense path's steps on the rows
    it touches, with gradients that shrink (where the largest second moment decides)."""
    from pstrain._formats.numerics.optimizer_rules import RULES, slot_specs

    cfg = pstrain.optimizers.Adam(0.05, amsgrad=True)._rule()
    rng = np.random.default_rng(9)
    start = rng.normal(size=(5, 3)).astype(np.float32)
    rows = np.array([1, 3])
    dense, sparse = start.copy(), start.copy()
    dense_slots = {n: np.full_like(start, i) for n, i in slot_specs(cfg).items()}
    sparse_slots = {n: np.full_like(start, i) for n, i in slot_specs(cfg).items()}
    for t, scale in enumerate([1.0, 1e-3, 1e-3], 1):
        g = np.zeros_like(start)
        g[rows] = rng.normal(size=(2, 3)).astype(np.float32) * scale
        sub = dense[rows]
        sub_slots = {n: a[rows] for n, a in dense_slots.items()}
        RULES["adam"](sub, g[rows], None, sub_slots, cfg, t)
        dense[rows] = sub
        for n in dense_slots:
            dense_slots[n][rows] = sub_slots[n]
        RULES["adam"](sparse, g[rows], rows, sparse_slots, cfg, t)
    np.testing.assert_allclose(sparse, dense, rtol=1e-6)
    assert np.array_equal(sparse[[0, 2, 4]], start[[0, 2, 4]])  # rows not touched stay
    assert (sparse_slots["v_hat"][rows] > sparse_slots["v"][rows]).all()  # the max held
