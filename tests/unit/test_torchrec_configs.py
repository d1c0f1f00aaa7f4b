"""TorchRec's table definitions map one to one onto TableConfig: every field has a meaning
here or is refused by name (a setting that changes the model is never dropped)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

import pstrain.torch as ptorch
from pstrain.errors import InvalidArgumentError
from pstrain.initializers import (
    Constant,
    Ones,
    RandomNormal,
    RandomUniform,
    TruncatedNormal,
    Zeros,
)

pytestmark = pytest.mark.timeout(60)

#: TorchRec 1.9.2's EmbeddingBagConfig fields, in its order (dataclasses.fields of its own).
TORCHREC_FIELDS = [
    "num_embeddings",
    "embedding_dim",
    "name",
    "data_type",
    "feature_names",
    "weight_init_max",
    "weight_init_min",
    "num_embeddings_post_pruning",
    "init_fn",
    "need_pos",
    "input_dim",
    "total_num_buckets",
    "use_virtual_table",
    "virtual_table_eviction_policy",
    "enable_embedding_update",
    "stash_weights",
    "pooling",
]


def config(**kwargs):
    return ptorch.EmbeddingBagConfig(
        **{"num_embeddings": 100, "embedding_dim": 4, "name": "t", "feature_names": ["f"], **kwargs}
    )


def mapped(**kwargs):
    (table,) = ptorch.table_configs([config(**kwargs)])
    return table


def test_the_config_has_torchrecs_fields_in_its_order():
    assert [f.name for f in dataclasses.fields(ptorch.EmbeddingBagConfig)] == TORCHREC_FIELDS
    positional = ptorch.EmbeddingBagConfig(10, 2, "t", ptorch.DataType.FP16, ["a", "b"])
    assert positional.data_type is ptorch.DataType.FP16 and positional.feature_names == ["a", "b"]
    assert positional.num_features() == 2
    assert positional.get_weight_init_max() == pytest.approx(10**-0.5)
    assert positional.get_weight_init_min() == pytest.approx(-(10**-0.5))
    assert [p.name for p in ptorch.PoolingType] == ["SUM", "MEAN", "NONE"]


@pytest.mark.parametrize(
    "init_fn, kind, settings",
    [
        (None, RandomUniform, {"minval": -0.1, "maxval": 0.1}),  # TorchRec's default: ±sqrt(1/rows)
        (
            functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1),
            RandomUniform,
            {"minval": -0.1, "maxval": 0.1},
        ),
        (functools.partial(torch.nn.init.uniform_, b=0.5), RandomUniform, {"minval": 0.0, "maxval": 0.5}),
        (torch.nn.init.uniform_, RandomUniform, {"minval": 0.0, "maxval": 1.0}),
        (functools.partial(torch.nn.init.normal_, std=0.01), RandomNormal, {"mean": 0.0, "stddev": 0.01}),
        (functools.partial(torch.nn.init.normal_, 0.5, 2.0), RandomNormal, {"mean": 0.5, "stddev": 2.0}),
        (functools.partial(torch.nn.init.constant_, val=0.25), Constant, {"value": 0.25}),
        (torch.nn.init.zeros_, Zeros, {}),
        (torch.nn.init.ones_, Ones, {}),
        (torch.nn.init.trunc_normal_, TruncatedNormal, {"mean": 0.0, "stddev": 1.0}),
        (
            functools.partial(torch.nn.init.trunc_normal_, std=0.1, a=-0.2, b=0.2),
            TruncatedNormal,
            {"mean": 0.0, "stddev": 0.1},
        ),
        # PyTorch's fans of a (100, 4) weight: bound sqrt(6 / 104), std sqrt(2 / 104)
        (
            torch.nn.init.xavier_uniform_,
            RandomUniform,
            {"minval": -((6 / 104) ** 0.5), "maxval": (6 / 104) ** 0.5},
        ),
        (
            functools.partial(torch.nn.init.xavier_normal_, gain=2.0),
            RandomNormal,
            {"mean": 0.0, "stddev": 2 * (2 / 104) ** 0.5},
        ),
    ],
)
def test_init_fn_becomes_the_same_distribution(init_fn, kind, settings):
    table = mapped(init_fn=init_fn)
    assert type(table.initializer) is kind
    got = table.initializer.config()
    for key, want in settings.items():
        assert got[key] == pytest.approx(want), key


def test_xavier_uniform_draws_within_pytorchs_bound():
    values = mapped(init_fn=torch.nn.init.xavier_uniform_).initializer((100, 4))
    torch_values = torch.nn.init.xavier_uniform_(torch.empty(100, 4)).numpy()
    bound = (6 / 104) ** 0.5
    assert np.abs(values).max() <= bound and np.abs(torch_values).max() <= bound
    assert np.abs(values).max() > 0.9 * bound  # spread over the whole range, as PyTorch's


@pytest.mark.parametrize(
    "init_fn, match",
    [
        (lambda w: w.fill_(1.0), "has no pstrain initializer"),
        (torch.nn.init.kaiming_uniform_, "has no pstrain initializer"),
        (functools.partial(torch.nn.init.trunc_normal_, std=1.0, a=-3.0, b=3.0), "two standard deviations"),
    ],
)
def test_an_init_fn_without_a_counterpart_is_refused_by_name(init_fn, match):
    with pytest.raises(InvalidArgumentError, match=f"table 't'.*{match}"):
        mapped(init_fn=init_fn)


def test_data_types_map_or_are_refused():
    assert mapped().dtype == np.float32
    assert mapped(data_type=ptorch.DataType.FP16).dtype == np.float16
    assert mapped(data_type=torch.float16).dtype == np.float16
    assert mapped(data_type=np.float64).dtype == np.float64
    for kind in ("BF16", "INT8", "INT4"):
        with pytest.raises(
            InvalidArgumentError, match=f"table 't': data_type {kind} has no pstrain table type"
        ):
            mapped(data_type=ptorch.DataType[kind])


def test_a_virtual_table_is_a_dynamic_one():
    table = mapped(use_virtual_table=True, num_embeddings=2**50)
    assert table.num_embeddings is None
    assert mapped(num_embeddings_post_pruning=50).num_embeddings == 100  # inference only, as TorchRec's


@pytest.mark.parametrize(
    "field, value",
    [
        ("need_pos", True),
        ("input_dim", 8),
        ("total_num_buckets", 4),
        ("virtual_table_eviction_policy", object()),
        ("enable_embedding_update", True),
        ("stash_weights", True),
    ],
)
def test_settings_of_torchrecs_sharded_kernels_are_refused_by_name(field, value):
    with pytest.raises(InvalidArgumentError, match=f"table 't': {field}=.*sharded kernels"):
        mapped(**{field: value})


def test_unpooled_tables_are_refused_with_the_way_to_look_them_up():
    with pytest.raises(InvalidArgumentError, match="pooling NONE has no pstrain combiner.*embedding_lookup"):
        mapped(pooling=ptorch.PoolingType.NONE)


def test_a_config_written_in_the_old_order_is_refused_by_name():
    """Before TorchRec's order, ``feature_names`` came fourth and ``pooling`` fifth: given so
    now, they land in ``data_type`` and ``feature_names`` and are refused, not taken."""
    old_order = ptorch.EmbeddingBagConfig(10, 2, "t", ["f"], ptorch.PoolingType.SUM)
    with pytest.raises(InvalidArgumentError, match="feature_names must be a list of names"):
        ptorch.table_configs([old_order])
    with pytest.raises(InvalidArgumentError, match="data_type .* has no pstrain table type"):
        ptorch.table_configs([ptorch.EmbeddingBagConfig(10, 2, "t", ["f"], ["f"])])
