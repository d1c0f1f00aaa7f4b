"""pstrain.torch's pooled embeddings: pooled outputs and gradients equal PyTorch's own
``nn.EmbeddingBag`` (per-sample weights included), and a TorchRec-style
EmbeddingBagCollection reads and updates its tables with one request per ps."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pstrain
import pstrain.torch as ptorch
from pstrain import JaggedTensor, KeyedJaggedTensor, TableConfig
from pstrain.errors import InvalidArgumentError
from pstrain.partitioners import FixedShardsPartitioner
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(120)


def sharded_strategy(ps):
    spec = {"ps": [s.address for s in ps], "worker": ["127.0.0.1:9"]}
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
async def test_an_embedding_bag_matches_torchs_outputs_and_gradients(ps_pair, mode, weighted):
    async with sharded_strategy(ps_pair).scope():
        bag = ptorch.EmbeddingBag(30, 4, mode=mode, name="bag")
    weight = torch.tensor(await bag.table.numpy(), requires_grad=True)
    ids = torch.tensor([3, 3, 29, 0, 7, 3, 15], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 3, 4], dtype=torch.int64)  # an empty bag, then a long one
    psw = torch.tensor([0.5, 2.0, -1.0, 1.0, 3.0, 0.25, 1.5]) if weighted else None
    d_out = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=psw)
    (want * d_out).sum().backward()
    await bag.fetch(ids, offsets, psw)
    got = bag(ids, offsets, psw)
    (got * d_out).sum().backward()
    torch.testing.assert_close(got, want)
    grad, table = bag.gradient()
    assert table is bag.table and grad.indices.tolist() == [0, 3, 7, 15, 29]  # only rows looked up
    dense = np.zeros((30, 4), np.float32)
    dense[grad.indices] = grad.values
    np.testing.assert_allclose(dense, weight.grad.numpy(), rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidArgumentError, match="other bags"):
        bag(ids[:3], torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "max"},
        {"mode": "sum", "padding_idx": 3},
        {"mode": "mean", "padding_idx": -27},  # 3, counted from the end as PyTorch does
        {"mode": "max", "padding_idx": 3},
        {"mode": "sum", "include_last_offset": True},
        {"mode": "mean", "scale_grad_by_freq": True},
    ],
)
async def test_an_embedding_bag_takes_nn_embedding_bags_options(ps_pair, kwargs):
    """``max``, ``padding_idx``, ``include_last_offset`` and ``scale_grad_by_freq`` pool and
    differentiate as ``nn.EmbeddingBag`` with the same options; the padding row is never
    read nor updated."""
    async with sharded_strategy(ps_pair).scope():
        bag = ptorch.EmbeddingBag(30, 4, name="bag", **kwargs)
    weight = torch.tensor(await bag.table.numpy())
    ref = torch.nn.EmbeddingBag(30, 4, _weight=weight.clone(), **kwargs)
    ids = torch.tensor([3, 3, 29, 0, 7, 3, 15, 3], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 3, 4, 7], dtype=torch.int64)  # an empty bag; the last holds only 3
    if kwargs.get("include_last_offset"):
        offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    d_out = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    want = ref(ids, offsets)
    (want * d_out).sum().backward()
    await bag.fetch(ids, offsets)
    got = bag(ids, offsets)
    (got * d_out).sum().backward()
    torch.testing.assert_close(got, want)
    grad, _ = bag.gradient()
    padded = "padding_idx" in kwargs
    assert grad.indices.tolist() == ([0, 7, 15, 29] if padded else [0, 3, 7, 15, 29])
    dense = torch.zeros(30, 4)
    dense[torch.from_numpy(grad.indices)] = torch.from_numpy(grad.values)
    torch.testing.assert_close(dense, ref.weight.grad)


async def test_a_collection_without_is_weighted_ignores_the_batchs_weights(ps_server):
    """TorchRec: an unweighted EmbeddingBagCollection pools every id with weight 1 even when
    its KeyedJaggedTensor carries weights."""
    async with strategy_for(ps_server).scope():
        ebc = ptorch.EmbeddingBagCollection(
            [ptorch.EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="t", feature_names=["a"])]
        )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a"], np.array([1, 2, 3]), np.array([2, 1]), weights=np.array([2.0, 3.0, 4.0], np.float32)
    )
    assert kjt.length_per_key() == [3] and kjt.offset_per_key() == [0, 3]
    table = await ebc.collection.tables["t"].numpy()
    await ebc.pull(kjt)
    pooled = ebc(kjt)
    np.testing.assert_allclose(pooled.values().detach().numpy(), [table[1] + table[2], table[3]], rtol=1e-6)
    assert pooled.offset_per_key() == [0, 4] and pooled.key_dim() == 1
    assert not ebc.is_weighted() and ebc.embedding_bag_configs()[0].name == "t"


async def test_an_embedding_bag_collection_trains_as_torch_does(ps_pair):
    """TorchRec's configs map one to one; a step matches nn.EmbeddingBag + SGD in PyTorch."""
    configs = [
        SimpleNamespace(
            name="big",
            num_embeddings=400,
            embedding_dim=4,
            feature_names=["a", "b"],
            pooling=SimpleNamespace(name="SUM"),
            weight_init_min=None,
            weight_init_max=None,
        ),
        SimpleNamespace(
            name="small",
            num_embeddings=9,
            embedding_dim=2,
            feature_names=["c"],
            pooling=SimpleNamespace(name="MEAN"),
            weight_init_min=-0.5,
            weight_init_max=0.5,
            data_type=SimpleNamespace(name="FP32"),
        ),
    ]
    mapped = ptorch.table_configs(configs)
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.combiner) for t in mapped] == [
        ("big", 400, 4, ["a", "b"], "sum"),
        ("small", 9, 2, ["c"], "mean"),
    ]
    assert mapped[0].initializer.maxval == pytest.approx(0.05)  # TorchRec: sqrt(1 / rows)
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        ebc = ptorch.EmbeddingBagCollection(configs, shard_rows=100)
        opt = pstrain.optimizers.SGD(0.1)
    assert ebc.plan["big"].kind == "row-sharded"
    weights = {n: torch.tensor(await t.numpy(), requires_grad=True) for n, t in ebc.collection.tables.items()}
    kjt = KeyedJaggedTensor(["a", "b", "c"], [1, 399, 1, 5, 5, 0, 8, 8, 2], lengths=[3, 0, 2, 1, 1, 2])
    with pstrain.count_requests() as reads:
        await ebc.pull(kjt)
    assert reads.to("ps") == 2
    pooled = ebc(kjt)
    assert pooled.keys() == ["a", "b", "c"] and pooled.length_per_key() == [4, 4, 2]
    target = torch.linspace(-1, 1, 20).reshape(2, 10)
    loss = ((pooled.values() - target) ** 2).sum()
    loss.backward()
    # the same with PyTorch's own modules
    want = []
    for feature, table, mode in (("a", "big", "sum"), ("b", "big", "sum"), ("c", "small", "mean")):
        jt = kjt[feature]
        want.append(
            torch.nn.functional.embedding_bag(
                torch.from_numpy(jt.values), weights[table], torch.from_numpy(jt.offsets[:-1]), mode=mode
            )
        )
    ((torch.cat(want, 1) - target) ** 2).sum().backward()
    torch.testing.assert_close(pooled.values(), torch.cat(want, 1))
    with pstrain.count_requests() as updates:
        await opt.apply_gradients(ebc.gradients())
    assert updates.to("ps") == 2
    for name, t in ebc.collection.tables.items():
        expected = weights[name].detach() - 0.1 * weights[name].grad
        np.testing.assert_allclose(await t.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


async def test_bags_refuse_what_torch_refuses(ps_server):
    async with strategy_for(ps_server).scope():
        bag = ptorch.EmbeddingBag(5, 2, mode="mean")
        with pytest.raises(InvalidArgumentError, match="combiner 'sqrtn' has no nn.EmbeddingBag"):
            ptorch.EmbeddingBagCollection([pstrain.TableConfig("t", 5, 2, combiner="sqrtn")])
    ids, offsets, w = torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([1.0, 2.0])
    await bag.fetch(ids, offsets)
    with pytest.raises(InvalidArgumentError, match="only with mode 'sum'"):
        bag(ids, offsets, w)
    with pytest.raises(InvalidArgumentError, match="mode must be"):
        ptorch.EmbeddingBag(5, 2, mode="median")
    with pytest.raises(InvalidArgumentError, match="max_norm"):
        ptorch.EmbeddingBag(5, 2, max_norm=1.0)
    with pytest.raises(InvalidArgumentError, match="padding_idx must be within"):
        ptorch.EmbeddingBag(5, 2, padding_idx=5)
    assert JaggedTensor.from_dense(np.array([[1, 2]])).to_lists() == [[1, 2]]


async def test_a_torchrec_port_keeps_its_configs_and_batches(ps_pair):
    """TorchRec's names as a port writes them: EmbeddingBagConfig, PoolingType,
    KeyedJaggedTensor.from_lengths_sync, is_weighted; weighted sums are PyTorch's."""
    configs = [
        ptorch.EmbeddingBagConfig(
            num_embeddings=50,
            embedding_dim=3,
            name="t1",
            feature_names=["f1"],
            pooling=ptorch.PoolingType.SUM,
        ),
        ptorch.EmbeddingBagConfig(
            num_embeddings=20,
            embedding_dim=2,
            name="t2",
            feature_names=["f2"],
            weight_init_min=-1.0,
            weight_init_max=1.0,
        ),
    ]
    async with strategy_for(*ps_pair).scope():
        ebc = ptorch.EmbeddingBagCollection(tables=configs, is_weighted=True, device="cpu")
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"],
        values=torch.tensor([4, 4, 49, 3, 7]),
        lengths=torch.tensor([2, 1, 0, 2]),
        weights=torch.tensor([0.5, 1.5, 2.0, 1.0, -1.0]),
    )
    assert kjt.offsets().tolist() == [0, 2, 3, 3, 5] and kjt.weights().tolist() == [0.5, 1.5, 2.0, 1.0, -1.0]
    tables = {n: torch.tensor(await t.numpy()) for n, t in ebc.collection.tables.items()}
    await ebc.pull(kjt)
    got = ebc(kjt).values()
    want = torch.cat(
        [
            torch.nn.functional.embedding_bag(
                torch.tensor([4, 4, 49]),
                tables["t1"],
                torch.tensor([0, 2]),
                mode="sum",
                per_sample_weights=torch.tensor([0.5, 1.5, 2.0]),
            ),
            torch.nn.functional.embedding_bag(
                torch.tensor([3, 7]),
                tables["t2"],
                torch.tensor([0, 0]),
                mode="sum",
                per_sample_weights=torch.tensor([1.0, -1.0]),
            ),
        ],
        1,
    )
    torch.testing.assert_close(got, want)
    unweighted = KeyedJaggedTensor(["f1", "f2"], [1, 2], lengths=[1, 0, 0, 1])
    await ebc.pull(unweighted)
    with pytest.raises(InvalidArgumentError, match="without weights"):
        ebc(unweighted)
    with pytest.raises(InvalidArgumentError, match="has no weights"):
        unweighted.weights()


async def test_torchrecs_init_fn_data_type_and_virtual_tables_reach_the_ps(ps_pair):
    """A TorchRec config's ``init_fn`` makes the table's values where it lives (sharded too),
    ``DataType.FP16`` a float16 table, ``use_virtual_table`` a dynamic one; a port's bags pool
    from them."""
    configs = [
        ptorch.EmbeddingBagConfig(
            num_embeddings=400,
            embedding_dim=4,
            name="big",
            feature_names=["a"],
            init_fn=functools.partial(torch.nn.init.constant_, val=0.25),
        ),
        ptorch.EmbeddingBagConfig(
            num_embeddings=9,
            embedding_dim=2,
            name="half",
            feature_names=["b"],
            data_type=ptorch.DataType.FP16,
        ),
        ptorch.EmbeddingBagConfig(
            num_embeddings=2**40, embedding_dim=3, name="virtual", feature_names=["c"], use_virtual_table=True
        ),
    ]
    async with strategy_for(*ps_pair).scope():
        ebc = ptorch.EmbeddingBagCollection(configs, shard_rows=100)
    assert ebc.plan["big"].kind == "row-sharded" and ebc.plan["virtual"].kind == "dynamic"
    np.testing.assert_array_equal(
        await ebc.collection.tables["big"].numpy(), np.full((400, 4), 0.25, np.float32)
    )
    half = await ebc.collection.tables["half"].numpy()
    assert half.dtype == np.float16 and np.abs(half).max() <= 3**-1
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], np.array([0, 399, 5, 2**39 + 7]), np.array([2, 0, 1, 0, 1, 0])
    )
    await ebc.pull(kjt)
    pooled = ebc.forward(kjt).to_dict()
    np.testing.assert_allclose(pooled["a"].detach().numpy(), [[0.5] * 4, [0.0] * 4])
    np.testing.assert_allclose(pooled["b"].detach().numpy()[0], half[5].astype(np.float32), rtol=1e-3)
    assert pooled["c"].shape == (2, 3)


async def test_steps_in_flight_each_pool_the_rows_they_pulled(ps_pair):
    """Two steps on one worker (``max_inflight_per_worker=2``): the second pulls its batch
    between the first's pull and its forward pass. Each forward pools its own batch's rows,
    and each step's gradients are for its own batch's ids."""
    async with strategy_for(*ps_pair).scope():
        ebc = ptorch.EmbeddingBagCollection(
            [
                ptorch.EmbeddingBagConfig(
                    num_embeddings=40, embedding_dim=3, name="t", feature_names=["a", "b"]
                )
            ]
        )
    table = torch.tensor(await ebc.collection.tables["t"].numpy())
    batches = [
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], np.array([1, 2, 3, 4]), np.array([2, 1, 1, 0])),
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], np.array([30, 31, 39]), np.array([1, 1, 0, 1])),
    ]
    await ebc.pull(batches[0])
    await ebc.pull(batches[1])  # the next step's pull lands before this step's forward
    for kjt, scale, ids in ((batches[0], 1.0, [1, 2, 3, 4]), (batches[1], 2.0, [30, 31, 39])):
        pooled = ebc(kjt).values()
        (scale * pooled).sum().backward()
        ((grad, _),) = ebc.gradients()
        want = torch.cat(
            [
                torch.nn.functional.embedding_bag(
                    torch.from_numpy(kjt[f].values.astype(np.int64)),
                    table,
                    torch.from_numpy(kjt[f].offsets[:-1]),
                    mode="sum",
                )
                for f in ("a", "b")
            ],
            1,
        )
        torch.testing.assert_close(pooled.detach(), want)
        assert grad.indices.tolist() == ids
        np.testing.assert_allclose(grad.values, scale)  # each id once in its batch: d(sum)/d(row) = scale
    unpulled = KeyedJaggedTensor.from_lengths_sync(["a", "b"], np.array([5]), np.array([1, 0]))
    with pytest.raises(InvalidArgumentError, match="forward got other features than were pulled"):
        ebc(unpulled)


async def test_an_embedding_bag_fetched_for_two_steps_pools_each_its_own_bags(ps_pair):
    async with sharded_strategy(ps_pair).scope():
        bag = ptorch.EmbeddingBag(30, 2, mode="sum", name="bag2")
    table = await bag.table.numpy()
    first = (torch.tensor([1, 2, 2, 5]), torch.tensor([0, 3]))
    second = (torch.tensor([20, 29]), torch.tensor([0]))
    await bag.fetch(*first)
    await bag.fetch(*second)
    for (ids, offsets), bags, want_ids in (
        (first, [[1, 2, 2], [5]], [1, 2, 5]),
        (second, [[20, 29]], [20, 29]),
    ):
        out = bag(ids, offsets)
        np.testing.assert_allclose(out.detach().numpy(), [table[b].sum(0) for b in bags], rtol=1e-6)
        out.sum().backward()
        grad, _ = bag.gradient()
        assert grad.indices.tolist() == want_ids
    with pytest.raises(InvalidArgumentError, match="other bags than were fetched"):
        bag(torch.tensor([7]), torch.tensor([0]))


def test_keyed_tensors_regroup_as_torchrecs():
    """TorchRec's ``KeyedTensor.regroup``, ``regroup_as_dict`` and ``from_tensor_list``
    (TorchRec 1.9.2's results for the same tensors), gradients flowing back."""
    values = torch.arange(10.0).reshape(2, 5).requires_grad_(True)
    kt1 = ptorch.KeyedTensor(["a", "b"], [2, 3], values)
    kt2 = ptorch.KeyedTensor(["c"], [1], torch.tensor([[100.0], [200.0]]))
    first, second = ptorch.KeyedTensor.regroup([kt1, kt2], [["c", "a"], ["b"]])
    assert first.tolist() == [[100.0, 0.0, 1.0], [200.0, 5.0, 6.0]]
    assert second.tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]
    (first.sum() + 2 * second.sum()).backward()
    assert values.grad.tolist() == [[1.0, 1.0, 2.0, 2.0, 2.0]] * 2
    named = ptorch.KeyedTensor.regroup_as_dict([kt1, kt2], [["b"], ["a"]], ["g1", "g2"])
    assert list(named) == ["g1", "g2"] and named["g2"].shape == (2, 2)
    kt = ptorch.KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 2), torch.zeros(2, 1)])
    assert kt.keys() == ["x", "y"] and kt.length_per_key() == [2, 1]
    assert kt.values().tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    with pytest.raises(InvalidArgumentError, match=r"no keyed tensor has the keys \['z'\]"):
        ptorch.KeyedTensor.regroup([kt1], [["a", "z"]])


def test_a_keyed_jagged_tensor_permutes_splits_and_moves_as_torchrecs():
    """``permute``, ``split`` and ``to`` (TorchRec 1.9.2's results for the same batch)."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 0, 2, 1, 0, 1])
    )
    permuted = kjt.permute([2, 0])
    assert permuted.keys() == ["c", "a"] and permuted.values().tolist() == [5, 1]
    assert permuted.lengths().tolist() == [0, 1, 1, 0]
    parts = kjt.split([1, 2])
    assert [(p.keys(), p.values().tolist(), p.lengths().tolist()) for p in parts] == [
        (["a"], [1], [1, 0]),
        (["b", "c"], [2, 3, 4, 5], [2, 1, 0, 1]),
    ]
    assert kjt.split([0, 3])[0].stride() == 2 and kjt.lengths_or_none().tolist() == [1, 0, 2, 1, 0, 1]
    assert kjt.to(torch.device("cpu")) is kjt and kjt.pin_memory() is kjt
    for bad, match in (
        (lambda: kjt.to("cuda:0"), "pools on the worker's CPU"),
        (lambda: kjt.permute([3]), r"indices must be in \[0, 3\)"),
        (lambda: kjt.split([1, 1]), "do not add up to its 3 keys"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            bad()


def _small_dlrm(*optimizers):
    """``pstrain.torch.DLRM`` over a row-sharded table (features a, b) and a small one (c),
    its dense parameters behind a RemoteModule; made in the caller's strategy scope with
    ``optimizers`` (called there), and a batch of two examples."""
    configs = [
        ptorch.EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=400, feature_names=["a", "b"]),
        ptorch.EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=9, feature_names=["c"]),
    ]
    ebc = ptorch.EmbeddingBagCollection(configs, shard_rows=100)
    model = ptorch.DLRM(ebc, dense_in_features=3, dense_arch_layer_sizes=[6, 4], over_arch_layer_sizes=[5, 1])
    remote = ptorch.RemoteModule(model, name="dlrm")
    kjt = KeyedJaggedTensor(["a", "b", "c"], [1, 399, 1, 5, 5, 0, 8, 8, 2], lengths=[3, 0, 2, 1, 1, 2])
    dense = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])
    return ebc, model, remote, [make() for make in optimizers], kjt, dense


async def test_torchrecs_dlrm_trains_with_its_tables_and_dense_parameters_on_the_ps(ps_pair):
    """``pstrain.torch.DLRM`` over a sharded EmbeddingBagCollection, its dense parameters
    kept on the ps by a RemoteModule: a step pulls both (one request per ps for the rows),
    and SGD on the ps moves every parameter and looked-up row by its gradient."""
    async with strategy_for(*ps_pair).scope():
        ebc, model, remote, (opt,), kjt, dense = _small_dlrm(lambda: pstrain.optimizers.SGD(0.1))
    assert ebc.plan["big"].kind == "row-sharded" and len(remote.variables) == 8  # the dense parts only
    with pstrain.count_requests() as reads:
        await ebc.pull(kjt)
    assert reads.to("ps") == 2
    await remote.pull()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tables = {n: await t.numpy() for n, t in ebc.collection.tables.items()}
    logits = model(dense, kjt)
    assert logits.shape == (2, 1)
    ((logits - torch.tensor([[1.0], [-1.0]])) ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    table_grads = ebc.gradients()
    await opt.apply_gradients([*table_grads, *remote.gradients()])
    await remote.pull()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - 0.1 * grads[n])
    for grad, table in table_grads:
        name = table.name.rsplit("/", 1)[-1]
        want = tables[name].copy()
        np.subtract.at(want, grad.indices, 0.1 * grad.values)
        np.testing.assert_allclose(await table.numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="same embedding_dim"):
        ptorch.DLRM(
            ptorch.EmbeddingBagCollection(
                [pstrain.TableConfig("x", 5, 2, ["x"]), pstrain.TableConfig("y", 5, 3, ["y"])]
            ),
            3,
            [2],
            [2, 1],
        )
    with pytest.raises(InvalidArgumentError, match="swish_layernorm"):
        ptorch.MLP(3, [4], activation="swish_layernorm")


async def test_a_torchrec_users_table_and_dense_optimizers_update_in_one_request_per_ps(ps_pair):
    """TorchRec's ``CombinedOptimizer`` (row-wise Adagrad fused into the tables, SGD for the
    dense parameters) as ``pstrain.optimizers.apply_together``: both steps in one request
    per ps, each optimizer's rule on its own variables."""
    async with strategy_for(*ps_pair).scope():
        ebc, model, remote, (rowwise, sgd), kjt, dense = _small_dlrm(
            lambda: pstrain.optimizers.RowWiseAdagrad(0.5, initial_accumulator_value=0.1),
            lambda: pstrain.optimizers.SGD(0.1),
        )
    await ebc.pull(kjt)
    await remote.pull()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tables = {n: await t.numpy() for n, t in ebc.collection.tables.items()}
    logits = model(dense, kjt)
    ((logits - torch.tensor([[1.0], [-1.0]])) ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    table_grads = ebc.gradients()
    with pstrain.count_requests() as updates:
        steps = await pstrain.optimizers.apply_together([(rowwise, table_grads), (sgd, remote.gradients())])
    assert steps == [1, 1]
    assert updates.per_op == {"opt/apply": 2} and sorted(updates.per_task.values()) == [1, 1], (
        updates.per_task
    )
    await remote.pull()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - 0.1 * grads[n])
    for grad, table in table_grads:
        want = tables[table.name.rsplit("/", 1)[-1]].copy()
        rows, g = np.asarray(grad.indices), np.asarray(grad.values, np.float64)
        acc = 0.1 + (g * g).mean(axis=1, keepdims=True)
        want[rows] -= 0.5 * g / (np.sqrt(acc) + 1e-8)
        np.testing.assert_allclose(await table.numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="given twice"):
        await pstrain.optimizers.apply_together([(sgd, table_grads), (sgd, remote.gradients())])
    with pytest.raises(InvalidArgumentError, match="takes \\(optimizer"):
        await pstrain.optimizers.apply_together([table_grads])
    assert int(await sgd.iterations.numpy()) == 1  # the refused steps applied nothing


async def test_a_checkpoint_saves_the_tables_of_embedding_bags_alone_or_in_a_model(tmp_path):
    """``pstrain.torch.EmbeddingBag`` and ``Embedding`` keep their tables on the ps: a
    checkpoint of one, or of a model holding one behind its RemoteModule, saves the table
    (it was refused, and left out of the model's) and restores it."""
    root = str(tmp_path)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = ptorch.EmbeddingBag(10, 4, name="in_model")
            self.head = torch.nn.Linear(4, 1)

    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as c:
        strategy = pstrain.ParameterServerStrategy(c.resolver)
        async with strategy.scope():
            bag, emb, model = (
                ptorch.EmbeddingBag(10, 4, name="alone"),
                ptorch.Embedding(10, 4, name="e"),
                Model(),
            )
            ptorch.RemoteModule(model, name="model")
        ckpt = pstrain.Checkpoint(bag=bag, emb=emb, model=model)
        path = await ckpt.save(f"{root}/ckpt")
        names = {n for n, _ in pstrain.checkpoint.list_variables(path)}
        assert {"bag/table", "emb/table", "model/bag/table", "model/head/weight"} <= names
        tables = [bag.table, emb.table, model.bag.table]
        saved = [await t.numpy() for t in tables]
        for t in tables:
            await t.assign(np.zeros((10, 4), np.float32))
        await ckpt.restore(path)
        for t, want in zip(tables, saved):
            np.testing.assert_array_equal(await t.numpy(), want)


async def test_a_checkpoint_of_an_embedding_bag_collection_saves_its_tables_own_optimizers(tmp_path):
    """pstrain ``TableConfig``s given to ``pstrain.torch.EmbeddingBagCollection`` may name
    their own optimizers: a checkpoint of the module saves their slots and step counts
    beside the tables, keyed by TorchRec's paths, and restores them."""
    root = str(tmp_path)
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as c:
        strategy = pstrain.ParameterServerStrategy(c.resolver)
        async with strategy.scope():
            opt = pstrain.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)
            ebc = ptorch.EmbeddingBagCollection([TableConfig("t", 10, 4, ["f"], optimizer=opt)])
        await ebc.pull({"f": JaggedTensor([1, 2, 2], [2, 1])})
        pooled = ebc({"f": JaggedTensor([1, 2, 2], [2, 1])})
        pooled.values().sum().backward()
        await ebc.collection.apply_gradients(ebc.gradients())  # the table's own optimizer
        ckpt = pstrain.Checkpoint(ebc=ebc)
        path = await ckpt.save(f"{root}/ckpt")
        saved = pstrain.checkpoint.load_variables(path)
        assert int(saved["ebc/optimizers/t/iterations"]) == 1
        slots = [k for k in saved if "accumulator" in k]
        assert slots, sorted(saved)
        np.testing.assert_allclose(saved[slots[0]][[1, 2]], 0.1 + np.array([[1.0], [4.0]]) * np.ones(4))
        await opt.iterations.assign(np.int64(7))
        await ckpt.restore(path)
        assert int(await opt.iterations.numpy()) == 1
