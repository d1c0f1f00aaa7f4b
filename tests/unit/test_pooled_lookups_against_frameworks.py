"""Lookups against the frameworks' own numbers: outputs and table gradients that
TensorFlow's lookups (sparse and of rows), TorchRec's ``EmbeddingBagCollection`` and its
unpooled ``EmbeddingCollection`` computed on random batches
(``references/make_references.py`` made the files, in environments with those
frameworks), compared with pstrain's on the same batches and tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain import EmbeddingCollection, JaggedTensor, KeyedJaggedTensor, SparseTensor, TableConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

REFERENCES = Path(__file__).resolve().parent / "references"
COMBINERS = ["sum", "mean", "sqrtn"]


def cases(name: str) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """The file's shared arrays, and each case's fields (cut from the flat arrays)."""
    with np.load(REFERENCES / name, allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    fields = [k for k in data if f"{k}_at" in data]
    n = data[fields[0] + "_at"].size - 1
    out = [{k: data[k][data[k + "_at"][i] : data[k + "_at"][i + 1]] for k in fields} for i in range(n)]
    return data, out


def dense_gradient(grad: pstrain.IndexedSlices, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, np.float32)
    np.add.at(out, grad.indices, grad.values)
    return out


def same_gradient(
    gradient, case: dict[str, np.ndarray], out_shape: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """``gradient`` (a lookup's, ``with_gradient=True``) of the case's upstream gradient is
    the table gradient TF's tape gave."""
    np.testing.assert_allclose(
        dense_gradient(gradient(case["upstream"].reshape(out_shape)), shape),
        case["grad"].reshape(shape),
        rtol=1e-4,
        atol=1e-5,
        err_msg=str(case.get("meta")),
    )


async def test_sparse_lookups_and_their_gradients_equal_tensorflows():
    shared, every = cases("tf_pooled_lookups.npz")
    params, batch = shared["params"], int(shared["batch"])
    table = pstrain.Variable(params.copy())
    checked_gradients = 0
    for c in every:
        width, weighted, combiner, safe, default_id, out_rows = c["meta"].tolist()
        index = np.stack([c["rows"], c["cols"]], 1)
        ids = SparseTensor(index, c["ids"], [batch, width])
        weights = SparseTensor(index, c["weights"], [batch, width]) if weighted else None
        want = c["out"].reshape(out_rows, params.shape[1])
        if safe:
            got, gradient = await pstrain.nn.safe_embedding_lookup_sparse(
                table,
                ids,
                weights,
                combiner=COMBINERS[combiner],
                default_id=None if default_id < 0 else default_id,
                with_gradient=True,
            )
        else:
            got, gradient = await pstrain.nn.embedding_lookup_sparse(
                table, ids, weights, combiner=COMBINERS[combiner], with_gradient=True
            )
        assert got.shape == want.shape, (c["meta"], got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(c["meta"]))
        # tape.gradient(loss, table) for the same upstream gradient (pruned ids none,
        # default_id's row its empty bags')
        same_gradient(gradient, c, want.shape, params.shape)
        checked_gradients += 1
        if safe:
            continue  # (a collection refuses invalid ids rather than prune them)
        # the same bags through a collection: its pooled rows and the gradient it sends
        lengths = np.bincount(c["rows"], minlength=batch)
        bags = JaggedTensor(c["ids"], lengths=lengths, weights=c["weights"] if weighted else None)
        collection = EmbeddingCollection(
            [TableConfig("t", params.shape[0], params.shape[1], ["f"], combiner=COMBINERS[combiner])]
        )
        await collection.tables["t"].assign(params)
        pooled = await collection.lookup({"f": bags})
        np.testing.assert_allclose(pooled.concat()[:out_rows], want, rtol=1e-5, atol=1e-5)
        assert not pooled.concat()[out_rows:].any()  # TF leaves out the empty bags at the end
        upstream = np.zeros_like(pooled.concat())
        upstream[:out_rows] = c["upstream"].reshape(out_rows, -1)
        ((grad, _),) = pooled.gradients(upstream)
        np.testing.assert_allclose(
            dense_gradient(grad, params.shape), c["grad"].reshape(params.shape), rtol=1e-4, atol=1e-5
        )
        checked_gradients += 1
    assert len(every) == 108 and checked_gradients == 108 + 36


async def test_lookups_with_max_norm_and_their_gradients_through_the_clipping_equal_tensorflows():
    shared, every = cases("tf_max_norm_lookups.npz")
    params, batch, max_norm = shared["params"], int(shared["batch"]), float(shared["max_norm"])
    norms = np.linalg.norm(params, axis=1)
    assert (norms > max_norm).any() and (norms < max_norm).any()  # (both kinds of row)
    table = pstrain.Variable(params.copy())
    for c in every:
        width, weighted, combiner, safe, out_rows = c["meta"].tolist()
        index = np.stack([c["rows"], c["cols"]], 1)
        ids = SparseTensor(index, c["ids"], [batch, width])
        weights = SparseTensor(index, c["weights"], [batch, width]) if weighted else None
        lookup = pstrain.nn.safe_embedding_lookup_sparse if safe else pstrain.nn.embedding_lookup_sparse
        got, gradient = await lookup(
            table, ids, weights, combiner=COMBINERS[combiner], max_norm=max_norm, with_gradient=True
        )
        want = c["out"].reshape(out_rows, params.shape[1])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(c["meta"]))
        same_gradient(gradient, c, want.shape, params.shape)
    assert len(every) == 4 * 2 * 3 * 2


async def test_row_lookups_and_their_gradients_equal_tensorflows():
    """``tf.nn.embedding_lookup`` of ids of rank 2, some repeated, with and without
    ``max_norm``: the rows, and ``tape.gradient``'s by the table (``with_gradient=True``)."""
    shared, every = cases("tf_row_lookups.npz")
    params = shared["params"]
    table = pstrain.Variable(params.copy())
    for c in every:
        ids, clip = c["ids"].reshape(3, 4), float(c["max_norm"][0])
        got, gradient = await pstrain.nn.embedding_lookup(
            table, ids, max_norm=clip or None, with_gradient=True
        )
        np.testing.assert_allclose(got, c["out"].reshape(got.shape), rtol=1e-5, atol=1e-6)
        same_gradient(gradient, c, got.shape, params.shape)
    assert len(every) == 12 and {float(c["max_norm"][0]) for c in every} == {0.0, 1.0}


async def test_embedding_bag_collections_pool_and_differentiate_as_torchrecs():
    import torch  # (an extra of the dev install, which make test installs)

    import pstrain.torch as ptorch

    _, every = cases("torchrec_pooled_lookups.npz")
    for c in every:
        batch, weighted, mean = c["meta"].tolist()
        pooling = ptorch.PoolingType.MEAN if mean else ptorch.PoolingType.SUM
        configs = [
            ptorch.EmbeddingBagConfig(
                name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"], pooling=pooling
            ),
            ptorch.EmbeddingBagConfig(
                name="t1", embedding_dim=3, num_embeddings=9, feature_names=["c"], pooling=pooling
            ),
        ]
        ebc = ptorch.EmbeddingBagCollection(configs, is_weighted=bool(weighted))
        tables = {"t0": c["t0"].reshape(15, 4), "t1": c["t1"].reshape(9, 3)}
        for name, values in tables.items():
            await ebc.collection.tables[name].assign(values)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c"], c["values"], c["lengths"], c["weights"] if weighted else None
        )
        await ebc.pull(kjt)
        pooled = ebc(kjt).values()
        want = c["out"].reshape(batch, 11)
        np.testing.assert_allclose(pooled.detach().numpy(), want, rtol=1e-5, atol=1e-6)
        (pooled * torch.from_numpy(c["upstream"].reshape(batch, 11))).sum().backward()
        got = {table.name.rsplit("/", 1)[-1]: grad for grad, table in ebc.gradients()}
        for name, values in tables.items():
            np.testing.assert_allclose(
                dense_gradient(got[name], values.shape),
                c[f"{name}_grad"].reshape(values.shape),
                rtol=1e-5,
                atol=1e-6,
            )
    assert len(every) == 36


async def test_embedding_collections_look_up_unpooled_and_differentiate_as_torchrecs():
    """TorchRec's ``EmbeddingCollection``: each feature's rows in the batch's order, its
    lengths, its ids as weights with ``need_indices``, a padded view cut and padded as
    ``to_padded_dense`` does, and the tables' gradients through both; the batch's weights
    ignored."""
    import torch

    import pstrain.torch as ptorch

    _, every = cases("torchrec_sequence_lookups.npz")
    for c in every:
        batch, need_indices, width = c["meta"].tolist()
        configs = [
            ptorch.EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"]),
            ptorch.EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["c"]),
        ]
        ec = ptorch.EmbeddingCollection(configs, need_indices=bool(need_indices))
        tables = {"t0": c["t0"].reshape(15, 4), "t1": c["t1"].reshape(9, 4)}
        for name, values in tables.items():
            await ec.collection.tables[name].assign(values)
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], c["values"], c["lengths"], c["weights"])
        await ec.pull(kjt)
        out = ec(kjt)
        assert list(out) == ["a", "b", "c"] and all(isinstance(j, ptorch.JaggedTensor) for j in out.values())
        rows = torch.cat([out[f].values() for f in ("a", "b", "c")])
        np.testing.assert_allclose(rows.detach().numpy(), c["out"].reshape(-1, 4), rtol=1e-6)
        lengths = torch.cat([out[f].lengths() for f in ("a", "b", "c")])
        np.testing.assert_array_equal(lengths.numpy(), c["out_lengths"])
        if need_indices:
            ids = torch.cat([out[f].weights() for f in ("a", "b", "c")])
            np.testing.assert_array_equal(ids.numpy(), c["indices"])
        else:
            assert all(j.weights_or_none() is None for j in out.values())
        padded = out["b"].to_padded_dense(desired_length=width, padding_value=-3.0)
        np.testing.assert_allclose(padded.detach().numpy(), c["padded"].reshape(batch, width, 4), rtol=1e-6)
        upstream = torch.from_numpy(c["upstream"].reshape(rows.shape))
        up_padded = torch.from_numpy(c["up_padded"].reshape(padded.shape))
        ((rows * upstream).sum() + (padded * up_padded).sum()).backward()
        got = {table.name.rsplit("/", 1)[-1]: grad for grad, table in ec.gradients()}
        for name, values in tables.items():
            np.testing.assert_allclose(
                dense_gradient(got[name], values.shape),
                c[f"{name}_grad"].reshape(values.shape),
                rtol=1e-5,
                atol=1e-6,
            )
    assert len(every) == 12 and {int(c["meta"][2]) for c in every} >= {0, 1, 2, 3}


async def test_row_lookups_of_ragged_ids_equal_tensorflows():
    """``tf.nn.embedding_lookup`` of a RaggedTensor of ids (empty rows among them), with and
    without ``max_norm``: the ragged rows, their ``to_tensor`` (cut to a width, or the
    longest row's), and the table's gradient of a loss over both."""
    shared, every = cases("tf_ragged_lookups.npz")
    params = shared["params"]
    table = pstrain.Variable(params.copy())
    cut = 0
    for c in every:
        clip, width, padded_width = c["meta"].tolist()
        ids = JaggedTensor(c["ids"], c["lengths"])
        rows, gradient = await pstrain.nn.embedding_lookup(
            table, ids, max_norm=clip or None, with_gradient=True
        )
        assert isinstance(rows, pstrain.nn.RaggedRows) and rows.nrows() == c["lengths"].size
        np.testing.assert_array_equal(rows.row_splits, c["splits"])
        np.testing.assert_allclose(rows.values, c["out"].reshape(-1, 3), rtol=1e-5, atol=1e-6)
        padded = rows.to_tensor(shape=[None, None if width < 0 else int(width), None])
        want = c["padded"].reshape(-1, int(padded_width), 3)
        np.testing.assert_allclose(padded, want, rtol=1e-5, atol=1e-6)
        cut += int(0 <= width < c["lengths"].max(initial=0))
        # the loss's gradient: the flat rows' and the padded rows' (through to_tensor) summed
        flat = gradient(c["upstream"].reshape(rows.values.shape))
        through_padded = gradient(c["up_padded"].reshape(padded.shape))
        got = dense_gradient(flat, params.shape) + dense_gradient(through_padded, params.shape)
        np.testing.assert_allclose(got, c["grad"].reshape(params.shape), rtol=1e-4, atol=1e-5)
    assert len(every) == 16 and cut >= 2
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="not a SparseTensor"):
        await pstrain.nn.embedding_lookup(table, SparseTensor([[0, 0]], [1], [1, 1]))
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="carry weights"):
        await pstrain.nn.embedding_lookup(table, JaggedTensor([1, 2], [2], weights=[1.0, 2.0]))


@pytest.mark.parametrize("reference", ["torchrec_dlrm.npz", "torchrec_dlrm_dcn.npz"])
async def test_torchrecs_dlrm_ports_with_its_parameters_and_computes_as_torchrecs(reference):
    """``torchrec.models.dlrm.DLRM`` (and ``DLRM_DCN``) over an EmbeddingBagCollection: the
    same model built from ``pstrain.torch`` takes TorchRec's dense parameters under their own
    names and gives its logits and every gradient (the tables' as sparse rows)."""
    import json

    import torch

    import pstrain.torch as ptorch

    shared, every = cases(reference)
    shapes = json.loads(str(shared["shapes"]))
    for c in every:
        (batch,) = c["meta"].tolist()
        configs = [
            ptorch.EmbeddingBagConfig(
                name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"]
            ),
            ptorch.EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["c"]),
        ]
        ebc = ptorch.EmbeddingBagCollection(configs)
        if "dcn" in reference:
            model = ptorch.DLRM_DCN(ebc, 5, [8, 4], [6, 3, 1], dcn_num_layers=2, dcn_low_rank_dim=3)
        else:
            model = ptorch.DLRM(ebc, 5, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[6, 3, 1])
        params = {n: torch.from_numpy(c[f"p:{n}"].reshape(shape)) for n, shape in shapes.items()}
        tables = {n.split(".")[-2]: p for n, p in params.items() if n.startswith("sparse_arch.")}
        dense = {n: p for n, p in params.items() if not n.startswith("sparse_arch.")}
        assert sorted(dict(model.named_parameters())) == sorted(dense)  # TorchRec's names
        model.load_state_dict(dense)
        for name, values in tables.items():
            await ebc.collection.tables[name].assign(values.numpy())
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], c["values"], c["lengths"])
        await ebc.pull(kjt)
        logits = model(torch.from_numpy(c["dense"].reshape(batch, 5)), kjt)
        np.testing.assert_allclose(logits.detach().numpy(), c["out"].reshape(batch, 1), rtol=1e-5, atol=1e-6)
        (logits * torch.from_numpy(c["upstream"].reshape(batch, 1))).sum().backward()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(
                p.grad.numpy(), c[f"g:{name}"].reshape(p.shape), rtol=1e-4, atol=1e-6, err_msg=name
            )
        got = {table.name.rsplit("/", 1)[-1]: grad for grad, table in ebc.gradients()}
        for name, values in tables.items():
            want = c[f"g:sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"]
            np.testing.assert_allclose(
                dense_gradient(got[name], tuple(values.shape)),
                want.reshape(values.shape),
                rtol=1e-4,
                atol=1e-6,
            )
    assert len(every) == 4
    assert ptorch.choose(27, 2) == 351 and ptorch.choose(3, 5) == 0
