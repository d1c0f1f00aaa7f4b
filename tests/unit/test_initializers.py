"""Keras' initializers: the variance each gives (Keras' formulas, written out here), the
bounds of the truncated and uniform ones, and the refusals of settings that make no
values."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pstrain
from pstrain import initializers as I
from pstrain.errors import InvalidArgumentError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SHAPE = (3, 200, 300)  # fan in 600, fan out 900: Keras multiplies by the receptive field
FAN = {"fan_in": 600.0, "fan_out": 900.0, "fan_avg": 750.0}
#: (initializer, scale, mode, distribution): Keras' settings of each named kind
NAMED = [
    (I.GlorotUniform, 1.0, "fan_avg", "uniform"),
    (I.GlorotNormal, 1.0, "fan_avg", "truncated_normal"),
    (I.HeNormal, 2.0, "fan_in", "truncated_normal"),
    (I.HeUniform, 2.0, "fan_in", "uniform"),
    (I.LecunNormal, 1.0, "fan_in", "truncated_normal"),
    (I.LecunUniform, 1.0, "fan_in", "uniform"),
]


def check_spread(values: np.ndarray, scale: float, mode: str, distribution: str) -> None:
    std = math.sqrt(scale / FAN[mode])  # Keras: the variance is scale / fan, whatever the law
    assert abs(values.std() / std - 1) < 0.01, (values.std(), std)
    assert abs(values.mean()) < 0.01 * std
    if distribution == "uniform":
        assert np.abs(values).max() <= math.sqrt(3) * std
    elif distribution == "truncated_normal":  # at two of the untruncated normal's deviations
        bound = 2 * std / 0.87962566103423978
        assert np.abs(values).max() <= bound * (1 + 1e-6) and np.abs(values).max() > 0.99 * bound
    else:
        assert np.abs(values).max() > 4 * std  # a normal's tail, with 180,000 draws


@pytest.mark.parametrize("cls, scale, mode, distribution", NAMED, ids=lambda x: getattr(x, "__name__", ""))
def test_the_named_kinds_have_keras_variance_and_bounds(cls, scale, mode, distribution):
    values = cls(seed=5)(SHAPE, np.float32)
    assert values.dtype == np.float32 and values.shape == SHAPE
    check_spread(values.astype(np.float64), scale, mode, distribution)
    same = I.VarianceScaling(scale, mode, distribution, seed=5)(SHAPE, np.float32)
    np.testing.assert_array_equal(values, same)  # each is its VarianceScaling
    np.testing.assert_array_equal(I.from_spec(cls(seed=5).spec())(SHAPE, np.float32), values)


@pytest.mark.parametrize("mode", ["fan_in", "fan_out", "fan_avg"])
@pytest.mark.parametrize("distribution", ["truncated_normal", "untruncated_normal", "uniform", "normal"])
def test_variance_scaling_every_mode_and_law(mode, distribution):
    values = I.VarianceScaling(0.5, mode, distribution, seed=1)(SHAPE, np.float64)
    check_spread(values, 0.5, mode, "truncated_normal" if distribution == "normal" else distribution)


def test_a_part_uses_the_whole_variables_fans():
    whole = (1000, 64)
    part = I.HeNormal(seed=2)((100, 64), np.float64, offset=(300, 0), full_shape=whole)
    assert abs(part.std() / math.sqrt(2 / 1000) - 1) < 0.03  # fan in of the whole: 1000, not 100


def test_orthogonal_is_orthogonal_and_its_parts_are_rows_of_the_whole():
    for shape in [(6, 4), (4, 6), (2, 3, 5)]:
        q = I.Orthogonal(gain=2.0, seed=3)(shape, np.float64).reshape(-1, shape[-1])
        small = q if q.shape[0] >= q.shape[1] else q.T
        np.testing.assert_allclose(small.T @ small, 4.0 * np.eye(small.shape[1]), atol=1e-12)
    whole = I.Orthogonal(seed=4)((10, 3), np.float32)
    part = I.Orthogonal(seed=4)((4, 3), np.float32, offset=(6, 0), full_shape=(10, 3))
    np.testing.assert_array_equal(part, whole[6:10])


def test_identity_and_its_parts():
    np.testing.assert_array_equal(I.Identity(3.0)((3, 5), np.float32), 3.0 * np.eye(3, 5, dtype=np.float32))
    part = I.Identity()((2, 4), np.float32, offset=(2, 0), full_shape=(5, 4))
    np.testing.assert_array_equal(part, np.eye(5, 4, dtype=np.float32)[2:4])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: I.VarianceScaling(scale=0), "scale must be positive"),
        (lambda: I.VarianceScaling(mode="fan_max"), "mode must be one of"),
        (lambda: I.VarianceScaling(distribution="cauchy"), "distribution must be one of"),
        (lambda: I.RandomUniform(1.0, 0.0), "minval 1.0 is above maxval 0.0"),
        (lambda: I.RandomNormal(stddev=-1), "stddev must be a finite number of 0 or more"),
        (lambda: I.TruncatedNormal(stddev=float("nan")), "stddev must be a finite number"),
        (lambda: I.RandomNormal(mean="0"), "mean must be a finite number, got .0."),
        (lambda: I.Constant("x"), "Constant takes a number"),
        (lambda: I.Zeros()((-1, 2)), "shape must be whole numbers of 0 or more"),
        (lambda: I.Zeros()((2.5, 2)), "shape must be whole numbers of 0 or more"),
        (lambda: I.Orthogonal()((5,)), "Orthogonal needs a variable of 2 or more dimensions"),
        (lambda: I.Identity()((2, 2, 2)), "Identity needs a 2-D variable"),
        (lambda: I.RandomUniform()((3,), np.int32), "needs minval < maxval"),
        (lambda: I.HeUniform()((3, 3), np.int32), "HeUniform needs a floating dtype"),
    ],
)
def test_settings_that_make_no_values_are_refused_by_name(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_a_variable_made_by_each_new_kind_outside_a_strategy():
    for init in (I.HeNormal(seed=1), I.Orthogonal(seed=1), I.Identity(), I.LecunUniform(seed=1)):
        v = pstrain.Variable(init, shape=(4, 4), dtype=np.float32)
        assert v.shape == (4, 4)
