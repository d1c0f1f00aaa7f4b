"""pstrain.torch's unpooled embeddings (TorchRec's ``EmbeddingCollection``, for sequence
features): a batch's rows for every feature in one request per ps, the rows and their
gradients PyTorch's own (``nn.functional.embedding`` over the same tables), updates in one
request per ps, dynamic tables, and a sequence model trained in closures on a worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pstrain
import pstrain.torch as ptorch
from pstrain import KeyedJaggedTensor
from pstrain.errors import InvalidArgumentError
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(120)


def sequence_configs() -> list[ptorch.EmbeddingConfig]:
    return [
        ptorch.EmbeddingConfig(
            num_embeddings=400, embedding_dim=4, name="items", feature_names=["clicks", "target"]
        ),
        ptorch.EmbeddingConfig(
            num_embeddings=9, embedding_dim=4, name="cats", weight_init_min=-0.5, weight_init_max=0.5
        ),
    ]


async def test_an_embedding_collection_trains_a_sequence_model_as_torch_does(ps_pair):
    """Attention-free but sequence-shaped: each example's last clicks (padded to 3, the
    longest cut), its target item and its category; the rows and the step are those of
    ``nn.functional.embedding`` over the same tables, with one request per ps each way."""
    async with strategy_for(*ps_pair).scope():
        ec = ptorch.EmbeddingCollection(sequence_configs(), device="cpu", shard_rows=100)
        opt = pstrain.optimizers.SGD(0.1)
    assert ec.plan["items"].kind == "row-sharded" and ec.embedding_dim() == 4
    assert ec.embedding_names_by_table() == [["clicks", "target"], ["cats"]]
    weights = {n: torch.tensor(await t.numpy(), requires_grad=True) for n, t in ec.collection.tables.items()}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["clicks", "target", "cats"],
        np.array([5, 399, 5, 7, 1, 3, 7, 250, 2, 8, 0]),
        np.array([4, 0, 1, 1, 1, 1, 1, 1, 1]),  # clicks: 4, none, 1; target: 1 each; cats: 1 each
    )
    with pstrain.count_requests() as reads:
        await ec.pull(kjt)
    assert reads.to("ps") == 2
    out = ec(kjt)
    assert list(out) == ["clicks", "target", "cats"] and out["clicks"].lengths().tolist() == [4, 0, 1]
    clicks = out["clicks"].to_padded_dense(3)
    assert clicks.shape == (3, 3, 4) and len(out["clicks"].to_dense()) == 3
    y = torch.tensor([1.0, -1.0, 0.5])

    def loss_of(clicks: torch.Tensor, target: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        score = ((clicks.sum(1) + cats) * target).sum(-1)
        return ((score - y) ** 2).sum()

    loss_of(clicks, out["target"].values(), out["cats"].values()).backward()
    ids = torch.from_numpy(kjt.values().astype(np.int64))
    want_clicks = torch.zeros(3, 3, 4)
    embedded = torch.nn.functional.embedding(ids[:5], weights["items"])
    want_clicks = want_clicks.index_put(
        (torch.tensor([0, 0, 0, 2]), torch.tensor([0, 1, 2, 0])), embedded[[0, 1, 2, 4]]
    )
    want_target = torch.nn.functional.embedding(ids[5:8], weights["items"])
    want_cats = torch.nn.functional.embedding(ids[8:], weights["cats"])
    torch.testing.assert_close(clicks, want_clicks)
    torch.testing.assert_close(out["target"].values(), want_target)
    loss_of(want_clicks, want_target, want_cats).backward()
    grads = ec.gradients()
    assert sorted(g.indices.tolist() for g, _ in grads) == [[0, 2, 8], [1, 3, 5, 7, 250, 399]]
    with pstrain.count_requests() as updates:
        await opt.apply_gradients(grads)
    assert updates.to("ps") == 2
    for name, t in ec.collection.tables.items():
        expected = weights[name].detach() - 0.1 * weights[name].grad
        np.testing.assert_allclose(await t.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


async def test_a_virtual_table_makes_its_rows_on_first_lookup_and_trains(ps_pair):
    """TorchRec's ``use_virtual_table=True``: a dynamic table; the rows a training pull
    makes are the table's, and their gradients update them where they live."""
    configs = [
        ptorch.EmbeddingConfig(
            num_embeddings=10, embedding_dim=3, name="users", feature_names=["u"], use_virtual_table=True
        )
    ]
    async with strategy_for(*ps_pair).scope():
        ec = ptorch.EmbeddingCollection(configs)
        opt = pstrain.optimizers.SGD(1.0)
    table = ec.collection.tables["users"]
    assert isinstance(table, pstrain.DynamicEmbedding)
    kjt = KeyedJaggedTensor(["u"], [10**12, 7, 10**12], lengths=[2, 1])  # ids past num_embeddings
    await ec.pull(kjt)
    rows = ec(kjt)["u"].values()
    first = await table.lookup(np.array([10**12, 7]), training=False)
    np.testing.assert_allclose(rows.detach().numpy(), first[[0, 1, 0]], rtol=1e-6)
    rows.sum().backward()
    await opt.apply_gradients(ec.gradients())
    after = await table.lookup(np.array([10**12, 7]), training=False)
    np.testing.assert_allclose(after, first - np.array([[2.0], [1.0]]), rtol=1e-5, atol=1e-6)


async def test_an_embedding_collection_refuses_what_torchrec_refuses(ps_server):
    async with strategy_for(ps_server).scope():
        with pytest.raises(InvalidArgumentError, match="same embedding_dim.*'b' has 3, the first 4"):
            ptorch.EmbeddingCollection(
                [
                    ptorch.EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="a"),
                    ptorch.EmbeddingConfig(num_embeddings=5, embedding_dim=3, name="b"),
                ]
            )
        with pytest.raises(InvalidArgumentError, match="EmbeddingConfig, which has no pooling"):
            ptorch.EmbeddingBagCollection(
                [ptorch.EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="a")]
            )
        with pytest.raises(InvalidArgumentError, match="'f' looks up two tables"):
            ptorch.EmbeddingCollection(
                [
                    ptorch.EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="a", feature_names=["f"]),
                    ptorch.EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="b", feature_names=["f"]),
                ]
            )
        # an EmbeddingBagConfig's pooling is ignored, as TorchRec's EmbeddingCollection does
        ec = ptorch.EmbeddingCollection(
            [
                ptorch.EmbeddingBagConfig(
                    num_embeddings=5, embedding_dim=2, name="t", pooling=ptorch.PoolingType.MEAN
                )
            ]
        )
    kjt = KeyedJaggedTensor(["t"], [1, 2, 4], lengths=[2, 1])
    with pytest.raises(InvalidArgumentError, match="pull the batch before forward"):
        ec(kjt)
    await ec.pull(kjt)
    with pytest.raises(InvalidArgumentError, match="other features than were pulled"):
        ec(KeyedJaggedTensor(["t"], [1, 3, 4], lengths=[2, 1]))
    table = await ec.collection.tables["t"].numpy()
    np.testing.assert_allclose(ec(kjt)["t"].values().detach().numpy(), table[[1, 2, 4]])  # unpooled
    with pytest.raises(InvalidArgumentError, match=r"id 5 is out of range \[0, 5\)"):
        await ec.pull(KeyedJaggedTensor(["t"], [5], lengths=[1]))
    with pytest.raises(InvalidArgumentError, match="do not split 3 values"):
        ptorch.JaggedTensor(torch.zeros(3, 2), lengths=torch.tensor([1, 1]))
    with pytest.raises(InvalidArgumentError, match="desired_length must be 0 or more"):
        ptorch.JaggedTensor(torch.zeros(3), lengths=torch.tensor([3])).to_padded_dense(-1)


async def test_a_sequence_model_trains_in_closures_on_a_worker():
    """A TorchRec user's loop as closures: the collection goes to the worker with the
    closure, pulls and updates there, and the loss falls."""
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            ec = ptorch.EmbeddingCollection(sequence_configs())
            opt = pstrain.optimizers.Adagrad(0.5)
        rng = np.random.default_rng(0)
        lengths = np.concatenate([rng.integers(0, 5, 32), np.ones(64, np.int64)])
        values = np.concatenate(
            [rng.integers(0, 400, int(lengths[:32].sum())), rng.integers(0, 400, 32), rng.integers(0, 9, 32)]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(["clicks", "target", "cats"], values, lengths)
        y = torch.from_numpy(rng.choice([-1.0, 1.0], 32).astype(np.float32))

        async def step() -> float:
            await ec.pull(kjt)
            out = ec(kjt)
            score = (
                (out["clicks"].to_padded_dense(4).sum(1) + out["cats"].values()) * out["target"].values()
            ).sum(-1)
            loss = ((score - y) ** 2).mean()
            loss.backward()
            await opt.apply_gradients(ec.gradients())
            return float(loss.detach())

        losses = []
        for _ in range(12):
            losses.append(await coordinator.schedule(step))
        assert losses[-1] < 0.5 * losses[0]
        await coordinator.close()


async def test_a_batch_built_from_torchrec_style_jagged_tensors_is_looked_up(ps_server):
    """TorchRec's way to build a batch: ``KeyedJaggedTensor.from_jt_dict`` of
    ``JaggedTensor(values=..., lengths=...)`` tensors (``pstrain.torch``'s, whose arrays
    are methods as TorchRec's are), weights kept."""
    async with strategy_for(ps_server).scope():
        ec = ptorch.EmbeddingCollection(
            [ptorch.EmbeddingConfig(num_embeddings=20, embedding_dim=2, name="t", feature_names=["a", "b"])]
        )
    kjt = KeyedJaggedTensor.from_jt_dict(
        {
            "a": ptorch.JaggedTensor(values=torch.tensor([3, 4, 5]), lengths=torch.tensor([2, 1])),
            "b": ptorch.JaggedTensor(
                values=torch.tensor([7]), offsets=torch.tensor([0, 0, 1]), weights=torch.tensor([0.5])
            ),
        }
    )
    assert kjt.stride() == 2 and kjt["a"].to_lists() == [[3, 4], [5]] and kjt["b"].weights.tolist() == [0.5]
    await ec.pull(kjt)
    out = ec(kjt)
    table = await ec.collection.tables["t"].numpy()
    np.testing.assert_allclose(out["a"].values().detach().numpy(), table[[3, 4, 5]])
    assert out["b"].offsets().tolist() == [0, 0, 1] and out["b"].to_dense()[0].shape == (0, 2)


async def test_a_checkpoint_of_a_torchrec_port_saves_its_tables_and_restores_them(tmp_path):
    """A TorchRec port checkpoints its model as a whole: the collections' tables (on the ps)
    are saved with the dense parameters, keyed as TorchRec's state_dict keys them, and come
    back on restore; a model whose dense parameters are still torch tensors of this process
    is refused rather than saved without them."""
    root = str(tmp_path)
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as c:
        strategy = pstrain.ParameterServerStrategy(c.resolver)
        async with strategy.scope():
            ebc = ptorch.EmbeddingBagCollection(
                [ptorch.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["a"])]
            )
            ec = ptorch.EmbeddingCollection(
                [ptorch.EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="u", feature_names=["b"])]
            )
            model = ptorch.DLRM(ebc, 3, [4], [2, 1])
            bare = ptorch.DLRM(
                ptorch.EmbeddingBagCollection(
                    [
                        ptorch.EmbeddingBagConfig(
                            num_embeddings=5, embedding_dim=4, name="v", feature_names=["c"]
                        )
                    ],
                    name="bare_bags",
                ),
                3,
                [4],
                [2, 1],
            )
            ptorch.RemoteModule(model, name="dlrm")
        ckpt = pstrain.Checkpoint(model=model, ec=ec)
        path = await ckpt.save(f"{root}/ckpt")
        names = [n for n, _ in pstrain.checkpoint.list_variables(path)]
        assert "model/sparse_arch/embedding_bag_collection/embedding_bags/t/weight" in names
        assert "ec/embeddings/u/weight" in names and "model/dense_arch/model/_mlp/0/_linear/weight" in names
        t, u = ebc.collection.tables["t"], ec.collection.tables["u"]
        saved_t, saved_u = await t.numpy(), await u.numpy()
        await t.assign(np.zeros((10, 4), np.float32))
        await u.assign(np.zeros((10, 4), np.float32))
        await ckpt.restore(path)
        np.testing.assert_array_equal(await t.numpy(), saved_t)
        np.testing.assert_array_equal(await u.numpy(), saved_u)
        with pytest.raises(InvalidArgumentError, match="RemoteModule"):
            pstrain.Checkpoint(model=bare)


async def test_torchrecs_own_keyed_jagged_tensor_is_taken_as_it_is(ps_server):
    """A port whose pipeline still builds TorchRec's KeyedJaggedTensor (anything with
    ``keys()`` and a ``to_dict()`` of TorchRec JaggedTensors) pulls and looks it up."""

    class TorchRecKJT:  # TorchRec's interface, as its KeyedJaggedTensor has it
        def __init__(self, jts: dict) -> None:
            self._jts = jts

        def keys(self) -> list[str]:
            return list(self._jts)

        def to_dict(self) -> dict:
            return dict(self._jts)

    async with strategy_for(ps_server).scope():
        ebc = ptorch.EmbeddingBagCollection(
            [ptorch.EmbeddingBagConfig(num_embeddings=20, embedding_dim=2, name="t", feature_names=["a"])]
        )
    kjt = TorchRecKJT(
        {"a": ptorch.JaggedTensor(values=torch.tensor([3, 4, 5]), lengths=torch.tensor([2, 1]))}
    )
    await ebc.pull(kjt)
    table = await ebc.collection.tables["t"].numpy()
    np.testing.assert_allclose(ebc(kjt).values().detach().numpy(), [table[3] + table[4], table[5]], rtol=1e-6)
    with pytest.raises(InvalidArgumentError, match="takes a KeyedJaggedTensor"):
        await ebc.pull([1, 2, 3])
