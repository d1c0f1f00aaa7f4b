"""Makes the reference files the tests compare pstrain with: outputs and table gradients
of TensorFlow's sparse lookups and of TorchRec's EmbeddingBagCollection and
EmbeddingCollection on random batches, and Keras' schedules, metrics, optimizers and
gradient clipping on random inputs. Run it in an environment that has the framework
(pstrain's does not need it): ``python make_references.py tf`` (and ``tf_max_norm``,
``tf_rows``, ``tf_ragged``, ``tf_scatter``, ``tf_strings``, ``tf_manager``,
``tf_text_lines``, ``tf_records``, ``tf_examples``, ``tf_csv``, ``keras_clipping``,
``keras_schedules``, ``keras_metrics``, ``keras_optimizers``, ``keras_lookups``,
``keras_hashing``, ``keras_discretization``) with tensorflow-cpu, ``python make_references.py
torchrec`` (and ``torchrec_sequences``, ``torchrec_dlrm``, ``torchrec_dlrm_dcn``) with
torchrec (see ../../../../shared/anchors/README.md for both).

The ``.npz`` files hold flat arrays and, per case, offsets into them
(``np.savez_compressed``); the ``.json`` ones a list of cases."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
COMBINERS = ["sum", "mean", "sqrtn"]


class Packed:
    """Arrays of many cases, each field one flat array and its offsets."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, **fields: np.ndarray) -> None:
        for name, a in fields.items():
            self.parts.setdefault(name, []).append(np.asarray(a).reshape(-1))

    def save(self, path: Path, **extra: np.ndarray) -> None:
        out = dict(extra)
        for name, pieces in self.parts.items():
            out[name] = np.concatenate(pieces)
            out[name + "_at"] = np.cumsum([0] + [p.size for p in pieces])
        np.savez_compressed(path, **out)


def sparse_batch(
    rng: np.random.Generator, most: int, batch: int, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random SparseTensor's rows, columns (in row-major order) and ids: fewer than
    ``most`` of them, over ``batch`` rows and ``vocab`` ids."""
    nnz = int(rng.integers(1, most))
    rows = np.sort(rng.integers(0, batch, nnz))
    cols = np.zeros(nnz, np.int64)
    for i in range(1, nnz):
        cols[i] = cols[i - 1] + 1 if rows[i] == rows[i - 1] else 0
    return rows, cols, rng.integers(0, vocab, nnz).astype(np.int64)


def taped(
    params: np.ndarray, rng: np.random.Generator, lookup: Any, *args: Any, **kwargs: Any
) -> tuple[np.ndarray, ...]:
    """``lookup(table, *args, **kwargs)`` on a TF variable of ``params``, a random upstream
    gradient (drawn from ``rng``) and the table's gradient by TF's tape: ``(out, upstream,
    grad)``."""
    import tensorflow as tf

    table = tf.Variable(params)
    with tf.GradientTape() as tape:
        out = lookup(table, *args, **kwargs)
        upstream = rng.normal(size=out.shape).astype(np.float32)
        loss = tf.reduce_sum(out * upstream)
    grad = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    return out.numpy(), upstream, grad


def tf_cases(seed: int = 1, draws: int = 6) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    vocab, dim, batch = 20, 3, 9
    params = rng.normal(size=(vocab, dim)).astype(np.float32)
    packed = Packed()
    for _ in range(draws):
        rows, cols, ids = sparse_batch(rng, 25, batch, vocab)
        nnz = ids.size
        with_invalid = np.where(rng.random(nnz) < 0.2, -1, ids)
        weights = rng.choice([0.0, -0.5, 0.3, 1.0, 2.0], nnz).astype(np.float32)
        width = int(cols.max() + 1)
        for weighted in (0, 1):
            for combiner in range(3):
                for safe, default_id in ((0, -1), (1, -1), (1, 4)):
                    the_ids = with_invalid if safe else ids
                    sp = tf.sparse.SparseTensor(np.stack([rows, cols], 1), the_ids, [batch, width])
                    spw = tf.sparse.SparseTensor(sp.indices, weights, sp.dense_shape) if weighted else None
                    if safe:
                        kw = {"default_id": None if default_id < 0 else default_id}
                        lookup = functools.partial(tf.nn.safe_embedding_lookup_sparse, **kw)
                    else:
                        lookup = tf.nn.embedding_lookup_sparse
                    out, upstream, grad = taped(params, rng, lookup, sp, spw, combiner=COMBINERS[combiner])
                    packed.add(
                        rows=rows,
                        cols=cols,
                        ids=the_ids,
                        weights=weights,
                        meta=np.array([width, weighted, combiner, safe, default_id, out.shape[0]]),
                        out=out,
                        upstream=upstream,
                        grad=grad,
                    )
    packed.save(
        HERE / "tf_pooled_lookups.npz",
        params=params,
        batch=np.array(batch),
        version=np.array(tf.__version__),
    )


def tf_max_norm_cases(seed: int = 2, draws: int = 4, max_norm: float = 1.0) -> None:
    """TF's sparse lookups with ``max_norm`` (rows longer than it clipped before they are
    combined), and their gradients through the clipping."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    vocab, dim, batch = 12, 3, 6
    params = (rng.normal(size=(vocab, dim)) * 0.9).astype(np.float32)  # about half past 1.0
    packed = Packed()
    for _ in range(draws):
        rows, cols, ids = sparse_batch(rng, 16, batch, vocab)
        weights = rng.choice([0.3, 1.0, 2.0], ids.size).astype(np.float32)
        width = int(cols.max() + 1)
        for weighted in (0, 1):
            for combiner in range(3):
                for safe in (0, 1):
                    sp = tf.sparse.SparseTensor(np.stack([rows, cols], 1), ids, [batch, width])
                    spw = tf.sparse.SparseTensor(sp.indices, weights, sp.dense_shape) if weighted else None
                    lookup = tf.nn.safe_embedding_lookup_sparse if safe else tf.nn.embedding_lookup_sparse
                    out, upstream, grad = taped(
                        params, rng, lookup, sp, spw, combiner=COMBINERS[combiner], max_norm=max_norm
                    )
                    packed.add(
                        rows=rows,
                        cols=cols,
                        ids=ids,
                        weights=weights,
                        meta=np.array([width, weighted, combiner, safe, out.shape[0]]),
                        out=out,
                        upstream=upstream,
                        grad=grad,
                    )
    packed.save(
        HERE / "tf_max_norm_lookups.npz",
        params=params,
        batch=np.array(batch),
        max_norm=np.array(max_norm),
        version=np.array(tf.__version__),
    )


def tf_row_lookup_cases(seed: int = 3, draws: int = 6) -> None:
    """TF's ``tf.nn.embedding_lookup`` of ids of rank 2 (some repeated), with and without
    ``max_norm``, and the table's gradient."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    vocab, dim = 10, 4
    params = (rng.normal(size=(vocab, dim)) * 0.7).astype(np.float32)
    packed = Packed()
    for _ in range(draws):
        ids = rng.integers(0, vocab, (3, 4)).astype(np.int64)
        for clip in (0.0, 1.0):
            out, upstream, grad = taped(params, rng, tf.nn.embedding_lookup, ids, max_norm=clip or None)
            packed.add(ids=ids, max_norm=np.array([clip]), out=out, upstream=upstream, grad=grad)
    packed.save(HERE / "tf_row_lookups.npz", params=params, version=np.array(tf.__version__))


def tf_ragged_lookup_cases(seed: int = 12, draws: int = 8) -> None:
    """TF's ``tf.nn.embedding_lookup`` of a RaggedTensor of ids (empty rows among them), with
    and without ``max_norm``: the ragged rows, the padded ``to_tensor`` (cut to a width drawn
    at random, or the longest row's) and the table's gradient of a loss over both."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    vocab, dim = 10, 3
    params = (rng.normal(size=(vocab, dim)) * 0.7).astype(np.float32)
    packed = Packed()
    for case in range(draws):
        lengths = rng.integers(0, 5, int(rng.integers(1, 6)))
        ids = rng.integers(0, vocab, int(lengths.sum())).astype(np.int64)
        width = int(rng.integers(0, 5)) if case % 2 else -1  # -1: to_tensor() as it is
        for clip in (0.0, 1.0):
            table = tf.Variable(params)
            ragged = tf.RaggedTensor.from_row_lengths(ids, lengths)
            with tf.GradientTape() as tape:
                out = tf.nn.embedding_lookup(table, ragged, max_norm=clip or None)
                padded = out.to_tensor(shape=[None, None if width < 0 else width, None])
                upstream = rng.normal(size=out.flat_values.shape).astype(np.float32)
                up_padded = rng.normal(size=padded.shape).astype(np.float32)
                loss = tf.reduce_sum(out.flat_values * upstream) + tf.reduce_sum(padded * up_padded)
            grad = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
            packed.add(
                lengths=lengths,
                ids=ids,
                meta=np.array([clip, width, padded.shape[1]]),
                out=out.flat_values.numpy(),
                splits=out.row_splits.numpy(),
                padded=padded.numpy(),
                upstream=upstream,
                up_padded=up_padded,
                grad=grad,
            )
    packed.save(HERE / "tf_ragged_lookups.npz", params=params, version=np.array(tf.__version__))


def torchrec_cases(seed: int = 1, draws: int = 12) -> None:
    import torch
    import torchrec
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

    rng = np.random.default_rng(seed)
    packed = Packed()
    for case in range(draws):
        batch = int(rng.integers(1, 8))
        for weighted, mean in ((0, 0), (0, 1), (1, 0)):  # (weighted mean: refused by TorchRec)
            torch.manual_seed(case)
            pooling = PoolingType.MEAN if mean else PoolingType.SUM
            configs = [
                EmbeddingBagConfig(
                    name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"], pooling=pooling
                ),
                EmbeddingBagConfig(
                    name="t1", embedding_dim=3, num_embeddings=9, feature_names=["c"], pooling=pooling
                ),
            ]
            ebc = EmbeddingBagCollection(
                tables=configs, is_weighted=bool(weighted), device=torch.device("cpu")
            )
            lengths = rng.integers(0, 4, 3 * batch)
            values = np.concatenate(
                [
                    rng.integers(0, 15, int(lengths[: 2 * batch].sum())),
                    rng.integers(0, 9, int(lengths[2 * batch :].sum())),
                ]
            ).astype(np.int64)
            weights = rng.choice([0.5, 1.0, 2.0, -1.0], values.size).astype(np.float32)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                ["a", "b", "c"],
                torch.from_numpy(values),
                torch.from_numpy(lengths),
                torch.from_numpy(weights) if weighted else None,
            )
            pooled = ebc(kjt).values()
            upstream = torch.from_numpy(rng.normal(size=tuple(pooled.shape)).astype(np.float32))
            (pooled * upstream).sum().backward()
            t0, t1 = ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t1"].weight
            packed.add(
                lengths=lengths,
                values=values,
                weights=weights,
                meta=np.array([batch, weighted, mean]),
                out=pooled.detach().numpy(),
                upstream=upstream.numpy(),
                t0=t0.detach().numpy(),
                t1=t1.detach().numpy(),
                t0_grad=t0.grad.numpy(),
                t1_grad=t1.grad.numpy(),
            )
    packed.save(HERE / "torchrec_pooled_lookups.npz", version=np.array(torchrec.__version__))


def torchrec_sequence_cases(seed: int = 11, draws: int = 12) -> None:
    """TorchRec's EmbeddingCollection (unpooled): each feature's rows, a padded view of one
    feature (cut and padded), and the tables' gradients of a loss over both."""
    import torch
    import torchrec
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

    rng = np.random.default_rng(seed)
    packed = Packed()
    for case in range(draws):
        batch = int(rng.integers(1, 8))
        need_indices = case % 2
        torch.manual_seed(case)
        configs = [
            EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"]),
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["c"]),
        ]
        ec = EmbeddingCollection(tables=configs, need_indices=bool(need_indices), device=torch.device("cpu"))
        lengths = rng.integers(0, 5, 3 * batch)
        values = np.concatenate(
            [
                rng.integers(0, 15, int(lengths[: 2 * batch].sum())),
                rng.integers(0, 9, int(lengths[2 * batch :].sum())),
            ]
        ).astype(np.int64)
        weights = rng.choice([0.5, 2.0, -1.0], values.size).astype(np.float32)  # (ignored)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c"], torch.from_numpy(values), torch.from_numpy(lengths), torch.from_numpy(weights)
        )
        out = ec(kjt)
        rows = torch.cat([out[f].values() for f in ("a", "b", "c")])
        width = int(rng.integers(0, 4))
        padded = out["b"].to_padded_dense(desired_length=width, padding_value=-3.0)
        upstream = torch.from_numpy(rng.normal(size=tuple(rows.shape)).astype(np.float32))
        up_padded = torch.from_numpy(rng.normal(size=tuple(padded.shape)).astype(np.float32))
        ((rows * upstream).sum() + (padded * up_padded).sum()).backward()
        t0, t1 = ec.embeddings["t0"].weight, ec.embeddings["t1"].weight
        indices = torch.cat([out[f].weights() for f in ("a", "b", "c")]) if need_indices else torch.zeros(0)
        packed.add(
            lengths=lengths,
            values=values,
            weights=weights,
            meta=np.array([batch, need_indices, width]),
            out=rows.detach().numpy(),
            out_lengths=torch.cat([out[f].lengths() for f in ("a", "b", "c")]).numpy(),
            indices=indices.numpy(),
            padded=padded.detach().numpy(),
            upstream=upstream.numpy(),
            up_padded=up_padded.numpy(),
            t0=t0.detach().numpy(),
            t1=t1.detach().numpy(),
            t0_grad=t0.grad.numpy(),
            t1_grad=t1.grad.numpy(),
        )
    packed.save(HERE / "torchrec_sequence_lookups.npz", version=np.array(torchrec.__version__))


def torchrec_dlrm_cases(seed: int = 13, draws: int = 4, dcn: bool = False) -> None:
    """TorchRec's ``DLRM`` (``torchrec.models.dlrm``; ``DLRM_DCN`` with ``dcn``) on random
    batches: its dense parameters and tables, its logits, and every parameter's gradient of
    a loss over them."""
    import json

    import torch
    import torchrec
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    rng = np.random.default_rng(seed)
    packed = Packed()
    names: list[str] = []
    for case in range(draws):
        torch.manual_seed(case)
        configs = [
            EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=15, feature_names=["a", "b"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["c"]),
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        if dcn:
            model = DLRM_DCN(
                ebc,
                5,
                dense_arch_layer_sizes=[8, 4],
                over_arch_layer_sizes=[6, 3, 1],
                dcn_num_layers=2,
                dcn_low_rank_dim=3,
            )
        else:
            model = DLRM(ebc, 5, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[6, 3, 1])
        batch = int(rng.integers(1, 8))
        lengths = rng.integers(0, 4, 3 * batch)
        values = np.concatenate(
            [
                rng.integers(0, 15, int(lengths[: 2 * batch].sum())),
                rng.integers(0, 9, int(lengths[2 * batch :].sum())),
            ]
        ).astype(np.int64)
        dense = rng.normal(size=(batch, 5)).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c"], torch.from_numpy(values), torch.from_numpy(lengths)
        )
        logits = model(torch.from_numpy(dense), kjt)
        upstream = torch.from_numpy(rng.normal(size=tuple(logits.shape)).astype(np.float32))
        (logits * upstream).sum().backward()
        params = dict(model.named_parameters())
        names = sorted(params)
        packed.add(
            lengths=lengths,
            values=values,
            dense=dense,
            meta=np.array([batch]),
            out=logits.detach().numpy(),
            upstream=upstream.numpy(),
            **{f"p:{n}": params[n].detach().numpy() for n in names},
            **{f"g:{n}": params[n].grad.numpy() for n in names},
        )
    shapes = {n: list(p.shape) for n, p in dict(model.named_parameters()).items()}
    packed.save(
        HERE / ("torchrec_dlrm_dcn.npz" if dcn else "torchrec_dlrm.npz"),
        version=np.array(torchrec.__version__),
        shapes=np.array(json.dumps(shapes)),
    )


def keras_clipping_cases(seed: int = 4, draws: int = 8) -> None:
    """Keras' optimizers' ``clipnorm``, ``clipvalue`` and ``global_clipnorm`` on two dense
    gradients and a sparse one (rows repeated), limits that clip some and not others: what
    ``SGD(1.0, ...)`` subtracts from variables of zeros (the clipped gradients, a sparse
    one's repeated rows summed)."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    packed = Packed()
    for _ in range(draws):
        scale = float(rng.choice([0.1, 1.0, 10.0]))
        dense = [(rng.normal(size=s) * scale).astype(np.float32) for s in ((5, 3), (4,))]
        rows = rng.integers(0, 6, 5).astype(np.int64)  # some repeated
        values = (rng.normal(size=(5, 2)) * scale).astype(np.float32)
        for kind, how in enumerate(("clipnorm", "clipvalue", "global_clipnorm")):
            limit = float(rng.uniform(0.2, 12.0)) * scale  # some clip nothing
            variables = [tf.Variable(np.zeros(s, np.float32)) for s in ((5, 3), (4,), (6, 2))]
            grads = [tf.constant(d) for d in dense]
            grads.append(tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([6, 2])))
            keras.optimizers.SGD(1.0, **{how: limit}).apply_gradients(zip(grads, variables))
            packed.add(
                d0=dense[0],
                d1=dense[1],
                rows=rows,
                values=values,
                meta=np.array([kind, limit]),
                out0=-variables[0].numpy(),
                out1=-variables[1].numpy(),
                out2=-variables[2].numpy(),
            )
    packed.save(HERE / "keras_clipping.npz", version=np.array(keras.__version__))


def keras_schedule_cases() -> None:
    """Keras' learning-rate schedules at steps 0 to 120 (and some fractional ones), for
    settings that cover each branch: staircase, cycle, warm-up, restarts."""
    import json

    import keras

    s = keras.optimizers.schedules
    settings = [
        ("ExponentialDecay", dict(initial_learning_rate=0.1, decay_steps=7, decay_rate=0.8)),
        ("ExponentialDecay", dict(initial_learning_rate=0.1, decay_steps=7, decay_rate=0.8, staircase=True)),
        ("PiecewiseConstantDecay", dict(boundaries=[10, 50], values=[0.3, 0.2, 0.1])),
        ("CosineDecay", dict(initial_learning_rate=0.5, decay_steps=40, alpha=0.1)),
        ("CosineDecay", dict(initial_learning_rate=0.01, decay_steps=60, warmup_target=0.2, warmup_steps=15)),
        (
            "CosineDecay",
            dict(initial_learning_rate=0.01, decay_steps=60, alpha=0.05, warmup_target=0.2, warmup_steps=15),
        ),
        ("InverseTimeDecay", dict(initial_learning_rate=0.2, decay_steps=9, decay_rate=0.5)),
        ("InverseTimeDecay", dict(initial_learning_rate=0.2, decay_steps=9, decay_rate=0.5, staircase=True)),
        ("PolynomialDecay", dict(initial_learning_rate=0.3, decay_steps=50)),
        (
            "PolynomialDecay",
            dict(initial_learning_rate=0.3, decay_steps=50, end_learning_rate=0.01, power=2.0),
        ),
        (
            "PolynomialDecay",
            dict(initial_learning_rate=0.3, decay_steps=30, end_learning_rate=0.01, power=0.5, cycle=True),
        ),
        ("CosineDecayRestarts", dict(initial_learning_rate=0.4, first_decay_steps=10)),
        (
            "CosineDecayRestarts",
            dict(initial_learning_rate=0.4, first_decay_steps=10, t_mul=1.0, m_mul=0.5, alpha=0.1),
        ),
        ("CosineDecayRestarts", dict(initial_learning_rate=0.4, first_decay_steps=7, t_mul=1.5, m_mul=0.8)),
    ]
    steps = [float(x) for x in range(121)] + [0.5, 12.25, 44.75]
    cases = []
    for name, kwargs in settings:
        schedule = getattr(s, name)(**kwargs)
        cases.append({"name": name, "kwargs": kwargs, "rates": [float(schedule(x)) for x in steps]})
    out = {"version": keras.__version__, "steps": steps, "cases": cases}
    (HERE / "keras_schedules.json").write_text(json.dumps(out) + "\n")


def keras_metric_cases(seed: int = 5) -> None:
    """Keras' metrics after three ``update_state`` calls of random batches, labels and
    predictions of shape ``(n,)`` or ``(n, 1)``, with and without sample weights: each
    metric's ``result()``."""
    import json

    import keras

    rng = np.random.default_rng(seed)
    m = keras.metrics
    metrics = [
        ("BinaryAccuracy", {}),
        ("BinaryAccuracy", {"threshold": 0.3}),
        ("BinaryCrossentropy", {}),
        ("BinaryCrossentropy", {"from_logits": True}),
        ("BinaryCrossentropy", {"label_smoothing": 0.1}),
        ("Precision", {}),
        ("Precision", {"thresholds": 0.7}),
        ("Recall", {}),
        ("Recall", {"thresholds": 0.2}),
        ("MeanSquaredError", {}),
        ("RootMeanSquaredError", {}),
        ("MeanAbsoluteError", {}),
        ("AUC", {}),
        ("AUC", {"num_thresholds": 50}),
        ("AUC", {"curve": "PR"}),
        ("AUC", {"curve": "PR", "summation_method": "minoring"}),
        ("AUC", {"curve": "PR", "summation_method": "majoring", "num_thresholds": 20}),
        ("AUC", {"summation_method": "minoring"}),
        ("AUC", {"summation_method": "majoring"}),
        ("AUC", {"curve": "PRGAIN"}),
        ("AUC", {"from_logits": True}),
        ("AUC", {"thresholds": [0.1, 0.3, 0.5, 0.7, 0.9]}),
        ("AUC", {"curve": "PR", "thresholds": [0.25, 0.5, 0.75]}),
    ]
    cases = []
    for name, kwargs in metrics:
        for column in (False, True):
            for weighted in (False, True):
                batches = []
                for _ in range(3):
                    n = int(rng.integers(1, 9))
                    labels = rng.integers(0, 2, n).astype(np.float32)
                    if name in ("MeanSquaredError", "RootMeanSquaredError", "MeanAbsoluteError"):
                        labels = rng.normal(size=n).astype(np.float32)
                    if kwargs.get("from_logits"):  # (BinaryCrossentropy's and AUC's)
                        preds = rng.normal(size=n).astype(np.float32) * 3
                    else:
                        preds = rng.choice([0.0, 1.0, *rng.uniform(0, 1, 6)], n).astype(np.float32)
                    weights = rng.uniform(0, 2, n).astype(np.float32) if weighted else None
                    batches.append((labels, preds, weights))
                metric = getattr(m, name)(**kwargs)
                try:  # (Keras cannot weigh a (n,) batch its metric reduces to one value)
                    for labels, preds, weights in batches:
                        shape = (-1, 1) if column else (-1,)
                        metric.update_state(labels.reshape(shape), preds.reshape(shape), weights)
                    result = float(metric.result())
                except Exception:  # noqa: BLE001 - recorded: this case has no Keras number
                    result = None
                cases.append(
                    {
                        "name": name,
                        "kwargs": kwargs,
                        "column": column,
                        "batches": [
                            [b[0].tolist(), b[1].tolist(), None if b[2] is None else b[2].tolist()]
                            for b in batches
                        ],
                        "result": result,
                    }
                )
    # How each spreads a sample weight over values of other shapes (per example, per value)
    shaped = []
    for name, args, weight in [
        ("Mean", [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]], [1.0, 0.0, 1.0]),
        ("Mean", [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]], None),
        ("Mean", [[1.0, 2.0, 3.0]], [[1.0], [0.0], [1.0]]),
        ("Mean", [[[1.0, 2.0], [3.0, 4.0]]], [[1.0, 0.0], [0.0, 1.0]]),
        ("Mean", [np.arange(24.0).reshape(2, 3, 4).tolist()], [[1.0, 2.0, 0.0], [1.0, 1.0, 3.0]]),
        ("Mean", [np.arange(24.0).reshape(2, 3, 4).tolist()], [2.0, 1.0]),
        ("Mean", [[1.0, 3.0]], 2.0),
        ("Sum", [[[1.0, 2.0], [3.0, 4.0]]], [1.0, 0.0]),
        ("Accuracy", [[[1, 2], [3, 4]], [[1, 0], [3, 4]]], [1.0, 0.0]),
        ("Accuracy", [[[1, 2], [3, 4]], [[1, 0], [3, 4]]], None),
        ("SparseCategoricalAccuracy", [[[1], [2]], [[0.1, 0.8, 0.1], [0.5, 0.3, 0.2]]], [1.0, 3.0]),
        ("BinaryAccuracy", [[[1, 0], [0, 1]], [[0.9, 0.8], [0.2, 0.3]]], [1.0, 0.5]),
    ]:
        metric = getattr(m, name)()
        metric.update_state(
            *[np.array(a) for a in args], sample_weight=None if weight is None else np.array(weight)
        )
        shaped.append({"name": name, "args": args, "weight": weight, "result": float(metric.result())})
    # Precision and Recall over classes: top_k, class_id, both, with thresholds; labels of
    # any value (Keras counts every label that is not 0 as a positive)
    ranked = []
    rng = np.random.default_rng(seed + 100)
    for kwargs in [
        {"top_k": 1},
        {"top_k": 2},
        {"top_k": 3, "thresholds": 0.4},
        {"class_id": 0},
        {"class_id": 2, "thresholds": [0.3, 0.6]},
        {"top_k": 2, "class_id": 1},
        {},
    ]:
        for name in ("Precision", "Recall"):
            for weighted in (False, True):
                batches = []
                for _ in range(3):
                    n = int(rng.integers(1, 7))
                    labels = rng.choice([0.0, 0.0, 1.0, 1.0, 0.4, -1.0], (n, 4)).astype(np.float32)
                    preds = rng.choice([0.0, 1.0, 0.5, *rng.uniform(0, 1, 6)], (n, 4)).astype(np.float32)
                    weights = rng.uniform(0, 2, n).astype(np.float32) if weighted else None
                    batches.append((labels, preds, weights))
                metric = getattr(m, name)(**kwargs)
                for labels, preds, weights in batches:
                    metric.update_state(labels, preds, weights)
                result = metric.result()
                ranked.append(
                    {
                        "name": name,
                        "kwargs": kwargs,
                        "batches": [
                            [b[0].tolist(), b[1].tolist(), None if b[2] is None else b[2].tolist()]
                            for b in batches
                        ],
                        "result": np.asarray(result, np.float64).tolist(),
                    }
                )
    out = {"version": keras.__version__, "cases": cases, "weighted_shapes": shaped, "ranked": ranked}
    (HERE / "keras_metrics.json").write_text(json.dumps(out) + "\n")


def keras_optimizer_cases(seed: int = 6, steps: int = 3) -> None:
    """Keras 3's optimizers, with and without ``weight_decay`` (``AdamW`` is Adam's with it):
    a dense variable after ``steps`` steps of random gradients (some tiny, where epsilon
    counts)."""
    import json

    import keras

    rng = np.random.default_rng(seed)
    o = keras.optimizers
    settings = [
        ("SGD", {"learning_rate": 0.1, "weight_decay": 0.05}),
        ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.05}),
        ("Adagrad", {"learning_rate": 0.1, "weight_decay": 0.02}),
        ("Adam", {"learning_rate": 0.01, "weight_decay": 0.1}),
        ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}),
        ("RMSprop", {"learning_rate": 0.01, "weight_decay": 0.1}),
        ("Ftrl", {"learning_rate": 0.1, "weight_decay": 0.1}),
        ("SGD", {"learning_rate": 0.1}),
        ("SGD", {"learning_rate": 0.1, "momentum": 0.8, "nesterov": True}),
        ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.01}),
        ("Adam", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.99}),
        ("RMSprop", {"learning_rate": 0.01}),
        ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5}),
        ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
        (
            "Ftrl",
            {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02},
        ),
        (
            "Ftrl",
            {
                "learning_rate": 0.1,
                "learning_rate_power": -0.6,
                "l2_shrinkage_regularization_strength": 0.05,
                "beta": 0.3,
            },
        ),
        ("Adam", {"learning_rate": 0.05, "amsgrad": True}),
        ("AdamW", {"learning_rate": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    ]
    cases = []
    for name, kwargs in settings:
        start = rng.normal(size=(3, 4)).astype(np.float32)
        grads = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(steps)]
        grads[0][0] *= 1e-4  # a row of tiny gradients: epsilon decides its steps
        if kwargs.get("amsgrad"):  # gradients that shrink: the largest second moment decides
            grads[1] *= 1e-3
            grads[2] *= 1e-3
        var = keras.Variable(start)
        opt = getattr(o, name)(**kwargs)
        for g in grads:
            opt.apply_gradients([(g, var)])
        cases.append(
            {
                "name": name,
                "kwargs": kwargs,
                "start": start.tolist(),
                "grads": [g.tolist() for g in grads],
                "end": np.asarray(var).tolist(),
            }
        )
    out = {"version": keras.__version__, "cases": cases}
    (HERE / "keras_optimizers.json").write_text(json.dumps(out) + "\n")


def tf_scatter_cases(seed: int = 7) -> None:
    """Every scatter of ``tf.Variable`` (add, sub, mul, div, min, max, update) with repeated
    ids, on one start: the variable after it."""
    import json

    import tensorflow as tf

    rng = np.random.default_rng(seed)
    start = rng.normal(size=(9, 3)).astype(np.float32)
    ids = np.array([4, 1, 4, 0, 8, 4], np.int64)
    values = rng.normal(size=(6, 3)).astype(np.float32)
    out = {}
    for op in ("scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max"):
        v = tf.Variable(start)
        getattr(v, op)(tf.IndexedSlices(values, ids))
        out[op] = v.numpy().tolist()
    v = tf.Variable(start)  # update: each id once (TF leaves which of a repeated id's rows open)
    v.scatter_update(tf.IndexedSlices(values[[0, 1, 3, 4]], ids[[0, 1, 3, 4]]))
    out["scatter_update"] = v.numpy().tolist()
    data = {
        "version": tf.__version__,
        "start": start.tolist(),
        "ids": ids.tolist(),
        "values": values.tolist(),
    }
    (HERE / "tf_scatter.json").write_text(json.dumps({**data, "after": out}) + "\n")


def tf_string_cases(seed: int = 8) -> None:
    """``tf.fingerprint(..., "farmhash64")``, ``tf.strings.to_hash_bucket_fast`` and
    ``to_hash_bucket_strong`` (SipHash-2-4, four keys) of strings of every length up to 300
    (each branch of FarmHash, each tail of SipHash), ASCII and not."""
    import json

    import tensorflow as tf

    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz0123456789_-/ é中ü")
    strings = ["", "a", "b", "c", "d", "hello", "alice", "bob"]
    strings += ["".join(rng.choice(letters, n)) for n in range(1, 301)]
    fingerprints = tf.fingerprint(tf.constant(strings), method="farmhash64").numpy()
    as_ints = [str(int.from_bytes(bytes(row), "little")) for row in fingerprints]
    buckets = {
        str(k): tf.strings.to_hash_bucket_fast(tf.constant(strings), k).numpy().tolist() for k in (7, 1000003)
    }
    # SipHash-2-4 with a 128-bit key (Keras' Hashing with a salt: salt=133 is key [133, 133])
    strong = {
        f"{k0},{k1}": {
            str(n): tf.strings.to_hash_bucket_strong(tf.constant(strings), n, [k0, k1]).numpy().tolist()
            for n in (7, 1000003, 2**62)
        }
        for k0, k1 in ((0, 0), (133, 133), (133, 137), (2**63 - 25, 987654321))
    }
    out = {
        "version": tf.__version__,
        "strings": strings,
        "fingerprint64": as_ints,
        "buckets": buckets,
        "strong_buckets": strong,
    }
    (HERE / "tf_strings.json").write_text(json.dumps(out, ensure_ascii=False) + "\n")


#: Keras' ``StringLookup`` and ``IntegerLookup`` settings for ``keras_lookup_cases``: the
#: layer, its arguments, the vocabulary (or data to ``adapt`` to) and the inputs.
LOOKUP_CASES: list[dict[str, Any]] = [
    {
        "layer": "string",
        "kwargs": {},
        "vocabulary": ["a", "b", "c"],
        "inputs": [["a", "c", "z"], ["", "b", "a"]],
    },
    {
        "layer": "string",
        "kwargs": {"mask_token": ""},
        "vocabulary": ["a", "b", "c"],
        "inputs": [["a", "", "zz", "c"]],
    },
    {
        "layer": "string",
        "kwargs": {"num_oov_indices": 3},
        "vocabulary": ["earth", "wind", "fire"],
        "inputs": [["earth", "water", "air", "fire", "lava", "ice", "wind", "éclair"]],
    },
    {
        "layer": "string",
        "kwargs": {"num_oov_indices": 2, "mask_token": "[PAD]"},
        "vocabulary": ["x", "y"],
        "inputs": [["[PAD]", "x", "q", "r", "y", "s"]],
    },
    {
        "layer": "string",
        "kwargs": {"num_oov_indices": 0},
        "vocabulary": ["a", "b"],
        "inputs": [["a", "b", "b"]],
    },
    {"layer": "string", "kwargs": {"num_oov_indices": 0}, "vocabulary": ["a", "b"], "inputs": [["a", "q"]]},
    {
        "layer": "string",
        "kwargs": {"invert": True},
        "vocabulary": ["a", "b", "c"],
        "inputs": [[1, 3, 0, 2, 9]],
    },
    {
        "layer": "string",
        "kwargs": {"invert": True, "mask_token": "", "oov_token": "?"},
        "vocabulary": ["a", "b"],
        "inputs": [[0, 1, 2, 3, 7]],
    },
    {"layer": "string", "kwargs": {}, "vocabulary": ["a", "b", "a"], "inputs": [["a"]]},
    {"layer": "string", "kwargs": {}, "vocabulary": ["[UNK]", "a", "b"], "inputs": [["a", "b", "q"]]},
    {"layer": "string", "kwargs": {"mask_token": ""}, "vocabulary": ["a", "", "b"], "inputs": [["a"]]},
    {"layer": "string", "kwargs": {"max_tokens": 3}, "vocabulary": ["a", "b", "c"], "inputs": [["a"]]},
    {
        "layer": "string",
        "kwargs": {},
        "adapt": ["b", "a", "c", "b", "d", "a", "b", "e", "e", "d"],
        "inputs": [["a", "b", "c", "d", "e", "f"]],
    },
    {
        "layer": "string",
        "kwargs": {"max_tokens": 4, "mask_token": ""},
        "adapt": ["b", "a", "c", "b", "", "d", "a", "b", "e", "e", "d", ""],
        "inputs": [["a", "b", "c", "d", "e", ""]],
    },
    {"layer": "integer", "kwargs": {}, "vocabulary": [12, 36, 1138, 42], "inputs": [[12, 1138, 42, 7, 36]]},
    {
        "layer": "integer",
        "kwargs": {"num_oov_indices": 3},
        "vocabulary": [12, 36, 1138],
        "inputs": [[12, -5, 7, 1000, 36, 4]],
    },
    {
        "layer": "integer",
        "kwargs": {"num_oov_indices": 3, "oov_method": "farmhash"},
        "vocabulary": [12, 36, 1138],
        "inputs": [[12, -5, 7, 1000, 36, 4]],
    },
    {"layer": "integer", "kwargs": {"mask_token": 0}, "vocabulary": [5, 6], "inputs": [[0, 5, 9, 6]]},
    {
        "layer": "integer",
        "kwargs": {"invert": True},
        "vocabulary": [12, 36, 1138],
        "inputs": [[1, 2, 0, 3, 8]],
    },
    {
        "layer": "integer",
        "kwargs": {},
        "adapt": [3, 1, 3, 2, 3, 1, 7],
        "inputs": [[1, 2, 3, 7, 9]],
    },
]


def keras_lookup_cases() -> None:
    """Keras 3's ``StringLookup`` and ``IntegerLookup``: the indices (or tokens, inverted)
    of ``LOOKUP_CASES``' inputs, ``get_vocabulary()`` and ``vocabulary_size()``, or the kind
    of error the layer raised."""
    import json

    import keras
    import tensorflow as tf

    out = []
    for case in LOOKUP_CASES:
        make = keras.layers.StringLookup if case["layer"] == "string" else keras.layers.IntegerLookup
        record: dict[str, Any] = {**case, "error": None}
        try:
            if "adapt" in case:
                layer = make(**case["kwargs"])
                layer.adapt(np.array(case["adapt"]))
            else:
                layer = make(vocabulary=case["vocabulary"], **case["kwargs"])
            got = np.asarray(layer(tf.constant(case["inputs"])))
            record["output"] = [[v.decode() if isinstance(v, bytes) else int(v) for v in row] for row in got]
            record["vocabulary_out"] = [
                v.decode() if isinstance(v, bytes) else v for v in layer.get_vocabulary()
            ]
            record["vocabulary_out"] = [
                int(v) if isinstance(v, (int, np.integer)) else v for v in record["vocabulary_out"]
            ]
            record["vocabulary_size"] = int(layer.vocabulary_size())
        except Exception as exc:  # noqa: BLE001 - the kind of error is the reference
            record["error"] = type(exc).__name__
        out.append(record)
    (HERE / "keras_lookups.json").write_text(
        json.dumps({"version": keras.__version__, "cases": out}, ensure_ascii=False) + "\n"
    )


def keras_hashing_cases(seed: int = 15) -> None:
    """Keras 3's ``Hashing`` (strings and integers; ``mask_value``; ``salt``) and
    ``HashedCrossing`` (pairs and triples of string and integer features) on random inputs:
    the bins each gives."""
    import json

    import keras
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    words = ["", "a", "alice", "bob", "é中", "the quick brown fox", "12", "-7"]
    words += ["".join(rng.choice(list("abcdefghij0123456789"), int(n))) for n in rng.integers(1, 40, 24)]
    ints = [0, 1, -1, 7, 12, -7, 2**40, -(2**62), *rng.integers(-(10**9), 10**9, 24).tolist()]
    hashing = []
    for kwargs in (
        {"num_bins": 7},
        {"num_bins": 1000003},
        {"num_bins": 5, "mask_value": ""},
        {"num_bins": 9, "salt": 133},
        {"num_bins": 9, "salt": [133, 137]},
    ):
        layer = keras.layers.Hashing(**kwargs)
        out = np.asarray(layer(tf.constant(words))).tolist()
        hashing.append({"kwargs": kwargs, "inputs": words, "output": out})
    for kwargs in ({"num_bins": 11}, {"num_bins": 6, "mask_value": 0}):
        layer = keras.layers.Hashing(**kwargs)
        out = np.asarray(layer(tf.constant(ints, tf.int64))).tolist()
        hashing.append({"kwargs": kwargs, "inputs": ints, "output": out})
    crossing = []
    n = 16
    a = rng.choice(words, n).tolist()
    b = rng.choice(ints, n).tolist()
    c = rng.choice(words, n).tolist()
    for num_bins, features in ((10, [a, c]), (1000, [a, b]), (97, [b, b]), (2**40, [a, b, c])):
        tensors = [tf.constant(f) if isinstance(f[0], str) else tf.constant(f, tf.int64) for f in features]
        out = np.asarray(keras.layers.HashedCrossing(num_bins)(tensors)).tolist()
        crossing.append({"num_bins": num_bins, "features": features, "output": out})
    (HERE / "keras_hashing.json").write_text(
        json.dumps(
            {"version": keras.__version__, "hashing": hashing, "crossing": crossing}, ensure_ascii=False
        )
        + "\n"
    )


def keras_discretization_cases(seed: int = 16) -> None:
    """Keras 3's ``Discretization``: the bins of given boundaries, and the boundaries
    ``adapt`` finds (one array, or batches one by one; several ``num_bins`` and ``epsilon``)
    with the bins they give."""
    import json

    import keras

    rng = np.random.default_rng(seed)
    cases = []
    x = rng.normal(size=(6, 5)).astype(np.float32) * 3
    x[0, :3] = [-1.0, 0.0, 2.5]  # on the boundaries
    for boundaries in ([0.0], [-1.0, 0.0, 2.5], [-3.0, -1.0, 0.0, 0.5, 2.5, 7.0]):
        out = np.asarray(keras.layers.Discretization(bin_boundaries=boundaries)(x)).tolist()
        cases.append({"boundaries": boundaries, "inputs": x.tolist(), "output": out})
    for num_bins, epsilon, parts in ((4, 0.01, 1), (10, 0.01, 1), (5, 0.1, 3), (8, 0.001, 4), (3, 0.01, 2)):
        data = rng.gamma(2.0, 2.0, size=(parts, 700)).astype(np.float32)
        layer = keras.layers.Discretization(num_bins=num_bins, epsilon=epsilon)
        layer.adapt(data[0] if parts == 1 else [d for d in data])
        probe = rng.gamma(2.0, 2.0, size=40).astype(np.float32)
        cases.append(
            {
                "num_bins": num_bins,
                "epsilon": epsilon,
                "adapt": [d.tolist() for d in data],
                "boundaries_out": [float(b) for b in layer.bin_boundaries],
                "inputs": probe.tolist(),
                "output": np.asarray(layer(probe)).tolist(),
            }
        )
    (HERE / "keras_discretization.json").write_text(
        json.dumps({"version": keras.__version__, "cases": cases}) + "\n"
    )


#: Timelines of saves (hours after the manager was made) for ``tf_manager_cases``.
MANAGER_TIMELINES = [
    {"max_to_keep": 2, "hours": 1.0, "times": [0.4 * i for i in range(1, 13)]},
    {"max_to_keep": 1, "hours": 0.5, "times": [0.1, 0.2, 0.7, 0.75, 0.8, 1.6, 1.7, 2.5, 2.6]},
    {"max_to_keep": 3, "hours": 2.0, "times": [1.0, 2.5, 2.6, 2.7, 3.0, 5.0, 5.1, 5.2, 5.3, 9.0]},
    {"max_to_keep": 2, "hours": None, "times": [1.0, 2.0, 3.0, 4.0]},
]


def tf_manager_cases() -> None:
    """Which saves ``tf.train.CheckpointManager(max_to_keep, keep_checkpoint_every_n_hours)``
    leaves on disk after each save of a timeline (its clock set to each save's time), and
    which its ``checkpoints`` lists."""
    import json
    import os
    import tempfile
    from unittest import mock

    import tensorflow as tf

    start = 1_700_000_000.0
    out = []
    for case in MANAGER_TIMELINES:
        directory = tempfile.mkdtemp()
        clock = [start]
        with mock.patch("time.time", lambda clock=clock: clock[0]):
            manager = tf.train.CheckpointManager(
                tf.train.Checkpoint(v=tf.Variable(0.0)),
                directory,
                max_to_keep=case["max_to_keep"],
                keep_checkpoint_every_n_hours=case["hours"],
            )
            on_disk, listed = [], []
            for t in case["times"]:
                clock[0] = start + t * 3600.0
                manager.save()
                on_disk.append(
                    sorted(
                        int(p[len("ckpt-") : -len(".index")])
                        for p in os.listdir(directory)
                        if p.endswith(".index")
                    )
                )
                listed.append([int(p.rsplit("-", 1)[1]) for p in manager.checkpoints])
        out.append({**case, "on_disk": on_disk, "listed": listed})
    (HERE / "tf_manager.json").write_text(json.dumps({"version": tf.__version__, "cases": out}) + "\n")


#: Files for ``tf_text_line_cases``: line endings \n and \r\n, empty lines, a last line
#: without an ending, an empty file, a long line.
TEXT_FILES = {
    "a.txt": "a,1\r\nb,2\n\nlast",
    "b.txt": "x\ny\nz\n",
    "empty.txt": "",
    "c.txt": "\n\n" + "l" * 3000 + "\nend\r\n",
}


def tf_text_line_cases() -> None:
    """``tf.data.TextLineDataset``'s elements for files of ``TEXT_FILES``, plain and
    compressed (GZIP, ZLIB), one after another and with ``num_parallel_reads``."""
    import gzip
    import json
    import tempfile
    import zlib

    import tensorflow as tf

    directory = tempfile.mkdtemp()
    for name, text in TEXT_FILES.items():
        data = text.encode()
        (Path(directory) / name).write_bytes(data)
        (Path(directory) / (name + ".gz")).write_bytes(gzip.compress(data))
        (Path(directory) / (name + ".z")).write_bytes(zlib.compress(data))
    cases = []
    orders = [["a.txt"], ["a.txt", "b.txt"], ["b.txt", "empty.txt", "c.txt", "a.txt"]]
    for files in orders:
        for parallel in (None, 2, 3):
            for compression, suffix in ((None, ""), ("GZIP", ".gz"), ("ZLIB", ".z")):
                paths = [str(Path(directory) / (f + suffix)) for f in files]
                got = tf.data.TextLineDataset(paths, compression, num_parallel_reads=parallel)
                lines = [x.decode() for x in got.as_numpy_iterator()]
                cases.append(
                    {"files": files, "parallel": parallel, "compression": compression, "lines": lines}
                )
    out = {"version": tf.__version__, "files": TEXT_FILES, "cases": cases}
    (HERE / "tf_text_lines.json").write_text(json.dumps(out) + "\n")


def tf_record_cases(seed: int = 9) -> None:
    """TFRecord files as TF's ``TFRecordWriter`` writes them (plain, GZIP, ZLIB) of records
    of every kind (empty, ending in NUL bytes, of 20,480 bytes, random, ``tf.train.Example``\\ s),
    and the records ``tf.data.TFRecordDataset`` reads back from them, base64-encoded."""
    import base64
    import json
    import tempfile

    import tensorflow as tf

    rng = np.random.default_rng(seed)
    records = [
        b"",
        b"hello",
        b"ends in nul\x00\x00",
        bytes(range(256)) * 80,
        bytes(rng.integers(0, 256, 300).astype(np.uint8)),
    ]
    for i in range(3):
        example = tf.train.Example(
            features=tf.train.Features(
                feature={
                    "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(i)))),
                    "label": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i % 2)])),
                }
            )
        )
        records.append(example.SerializeToString())
    directory = tempfile.mkdtemp()
    files = {}
    for compression in ("", "GZIP", "ZLIB"):
        path = f"{directory}/records{compression}.tfrecord"
        with tf.io.TFRecordWriter(
            path, options=tf.io.TFRecordOptions(compression_type=compression)
        ) as writer:
            for record in records:
                writer.write(record)
        read = list(tf.data.TFRecordDataset(path, compression_type=compression).as_numpy_iterator())
        assert read == records
        files[compression] = base64.b64encode(Path(path).read_bytes()).decode()
    out = {
        "version": tf.__version__,
        "records": [base64.b64encode(r).decode() for r in records],
        "files": files,
    }
    (HERE / "tf_records.json").write_text(json.dumps(out) + "\n")


def tf_example_cases(seed: int = 10) -> None:
    """``tf.io.parse_example`` and ``parse_single_example`` of ``tf.train.Example`` records
    (some features missing, empty or long) by FixedLen and VarLen features of each type;
    the records base64-encoded, TF's arrays and sparse parts as lists, and which of a few
    bad specs TF refuses."""
    import base64
    import json

    import tensorflow as tf

    rng = np.random.default_rng(seed)
    records = []
    for i in range(6):
        feature = {
            "pair": tf.train.Feature(int64_list=tf.train.Int64List(value=[i, -i * 7])),
            "clicks": tf.train.Feature(
                int64_list=tf.train.Int64List(value=rng.integers(0, 10**12, i % 4).tolist())
            ),
            "weights": tf.train.Feature(float_list=tf.train.FloatList(value=rng.normal(size=i % 3).tolist())),
            "terms": tf.train.Feature(
                bytes_list=tf.train.BytesList(value=[b"t%d" % k for k in range(i % 3)])
            ),
            "history": tf.train.Feature(
                int64_list=tf.train.Int64List(value=rng.integers(0, 50, i % 5).tolist())
            ),
        }
        if i % 2:
            feature["label"] = tf.train.Feature(float_list=tf.train.FloatList(value=[float(i % 3 == 0)]))
        if i != 4:
            feature["country"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"c\x00%d" % i]))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        records.append(example.SerializeToString())
    spec = {
        "pair": tf.io.FixedLenFeature([2], tf.int64),
        "label": tf.io.FixedLenFeature([], tf.float32, default_value=-1.0),
        "country": tf.io.FixedLenFeature([], tf.string, default_value=b"none"),
        "clicks": tf.io.VarLenFeature(tf.int64),
        "weights": tf.io.VarLenFeature(tf.float32),
        "terms": tf.io.VarLenFeature(tf.string),
        "absent": tf.io.VarLenFeature(tf.int64),
        "history_ids": tf.io.RaggedFeature(tf.int64, value_key="history"),
    }

    def plain(value: Any) -> Any:
        if isinstance(value, tf.RaggedTensor):
            return {"values": value.values.numpy().tolist(), "row_splits": value.row_splits.numpy().tolist()}
        if isinstance(value, tf.SparseTensor):
            return {
                "indices": value.indices.numpy().tolist(),
                "values": [
                    base64.b64encode(v).decode() if isinstance(v, bytes) else v
                    for v in value.values.numpy().tolist()
                ],
                "dense_shape": value.dense_shape.numpy().tolist(),
            }
        out = value.numpy()
        if isinstance(out, bytes):
            return base64.b64encode(out).decode()
        if out.dtype == object:
            return [base64.b64encode(v).decode() for v in out.reshape(-1).tolist()]
        return out.tolist()

    batch = tf.io.parse_example(tf.constant(records), spec)
    single = tf.io.parse_single_example(tf.constant(records[3]), spec)
    refused = {}
    for label, bad in {
        "type": {"pair": tf.io.FixedLenFeature([2], tf.float32)},
        "missing": {"label": tf.io.FixedLenFeature([], tf.float32)},
        "length": {"pair": tf.io.FixedLenFeature([3], tf.int64)},
    }.items():
        try:
            tf.io.parse_example(tf.constant(records), bad)
            refused[label] = None
        except Exception as exc:  # noqa: BLE001 - the kind of error is the reference
            refused[label] = type(exc).__name__
    out = {
        "version": tf.__version__,
        "records": [base64.b64encode(r).decode() for r in records],
        "batch": {k: plain(v) for k, v in batch.items()},
        "single": {k: plain(v) for k, v in single.items()},
        "refused": refused,
    }
    (HERE / "tf_examples.json").write_text(json.dumps(out) + "\n")


#: ``tf_csv_cases``: lines, each column's (type, default or None: required), and arguments.
CSV_CASES = [
    (
        ["1,2.5,a", '3,,"b,c"', ",4.0,", '5,6,"say ""hi"""'],
        [("int32", 0), ("float32", 0.0), ("string", "x")],
        {},
    ),
    (["1,2.5,a", "3,,b"], [("int32", 0), ("float32", 0.0)], {"select_cols": [0, 1]}),
    (["1,2.5,a,9", "3,,b,8"], [("int64", None), ("string", "")], {"select_cols": [0, 3]}),
    (
        ["1\tNA\t2", "NA\t7\t-3"],
        [("int32", 0), ("int64", 9), ("float64", 0.5)],
        {"field_delim": "\t", "na_value": "NA"},
    ),
    (['1,"2"', "3,4"], [("int32", 0), ("string", "")], {"use_quote_delim": False}),
    ([" 1, 2.5 ", "-7,1e3"], [("int32", 0), ("float32", 0.0)], {}),
    (["2147483647,1"], [("int32", 0), ("int32", 0)], {}),
    (["1,2,3"], [("int32", 0), ("int32", 0)], {}),
    (["a,1"], [("int32", 0), ("int32", 0)], {}),
    ([",1"], [("int32", None), ("int32", 0)], {}),
    (["2147483648,1"], [("int32", 0), ("int32", 0)], {}),
    (["1.5,1"], [("int64", 0), ("int32", 0)], {}),
]


def tf_csv_cases() -> None:
    """``tf.io.decode_csv`` of ``CSV_CASES``: the columns, or the kind of error."""
    import json

    import tensorflow as tf

    out = []
    for lines, columns, kwargs in CSV_CASES:
        defaults = [
            tf.constant([], getattr(tf, kind)) if value is None else tf.constant([value], getattr(tf, kind))
            for kind, value in columns
        ]
        try:
            got = tf.io.decode_csv(tf.constant(lines), defaults, **kwargs)
            result = [[v.decode() if isinstance(v, bytes) else v for v in c.numpy().tolist()] for c in got]
            error = None
        except Exception as exc:  # noqa: BLE001 - the kind of error is the reference
            result, error = None, type(exc).__name__
        out.append({"lines": lines, "columns": columns, "kwargs": kwargs, "result": result, "error": error})
    (HERE / "tf_csv.json").write_text(json.dumps({"version": tf.__version__, "cases": out}) + "\n")


if __name__ == "__main__":
    {
        "tf": tf_cases,
        "tf_max_norm": tf_max_norm_cases,
        "tf_rows": tf_row_lookup_cases,
        "tf_ragged": tf_ragged_lookup_cases,
        "torchrec": torchrec_cases,
        "torchrec_sequences": torchrec_sequence_cases,
        "torchrec_dlrm": torchrec_dlrm_cases,
        "torchrec_dlrm_dcn": functools.partial(torchrec_dlrm_cases, seed=14, dcn=True),
        "keras_clipping": keras_clipping_cases,
        "keras_schedules": keras_schedule_cases,
        "keras_metrics": keras_metric_cases,
        "keras_lookups": keras_lookup_cases,
        "keras_hashing": keras_hashing_cases,
        "keras_discretization": keras_discretization_cases,
        "keras_optimizers": keras_optimizer_cases,
        "tf_scatter": tf_scatter_cases,
        "tf_strings": tf_string_cases,
        "tf_manager": tf_manager_cases,
        "tf_text_lines": tf_text_line_cases,
        "tf_records": tf_record_cases,
        "tf_examples": tf_example_cases,
        "tf_csv": tf_csv_cases,
    }[sys.argv[1]]()
