"""The public API is pstrain/__init__.py: its lazy table, what type checkers see, and the modules agree."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

import pstrain

INIT = Path(pstrain.__file__)


def type_checking_names() -> dict[str, str]:
    """``name -> module`` as the ``if TYPE_CHECKING:`` block of __init__.py imports them."""
    tree = ast.parse(INIT.read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    names: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} must be re-exported as itself"
            names[alias.name] = node.module or alias.name
    return names


def test_all_is_the_sorted_union_of_the_lazy_table_and_the_submodules():
    expected = sorted([*pstrain._EXPORTS, *pstrain._SUBMODULES, "__version__"])
    assert pstrain.__all__ == expected
    assert len(set(pstrain.__all__)) == len(pstrain.__all__)


def test_type_checkers_see_exactly_the_names_that_run():
    seen = type_checking_names()
    lazy = {**pstrain._EXPORTS, **{m: m for m in pstrain._SUBMODULES}}
    assert set(seen) == set(lazy), (
        f"only in TYPE_CHECKING: {set(seen) - set(lazy)}; only in the table: {set(lazy) - set(seen)}"
    )
    for name, module in lazy.items():
        assert seen[name] == module, (
            f"{name}: TYPE_CHECKING imports it from {seen[name]}, the table from {module}"
        )


@pytest.mark.parametrize("name", sorted(pstrain._EXPORTS))
def test_every_name_comes_from_the_module_that_defines_and_exports_it(name):
    module = importlib.import_module(f"pstrain.{pstrain._EXPORTS[name]}")
    assert name in module.__all__, f"pstrain.{module.__name__} does not list {name} in __all__"
    assert getattr(pstrain, name) is getattr(module, name)


def test_submodules_are_modules():
    for name in pstrain._SUBMODULES:
        assert getattr(pstrain, name) is importlib.import_module(f"pstrain.{name}")


def test_every_public_name_has_a_docstring():
    for name in pstrain.__all__:
        obj = getattr(pstrain, name)
        if callable(obj) or isinstance(obj, type):
            assert (obj.__doc__ or "").strip(), f"pstrain.{name} has no docstring"


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pstrain.Nope  # noqa: B018


API = json.loads((Path(__file__).parent / "public_api.json").read_text())


#: Names added since the snapshot (each a deliberate addition to the API).
ADDED = {
    "pstrain.errors": {
        "PsRestartedError",
        "FailedPreconditionError",
        "PlacementChangedError",
        "ResourceExhaustedError",  # tables larger than memory (issue 64)
        "DataLossError",  # a tiered restore's linked checkpoint file changed in place (issue 64)
    },
    "pstrain": {
        "math",
        "schedules",
        "strings",  # TF's string hashing, bucket for bucket
        # ranking models (issue 61)
        "nn",
        "embedding_lookup_sparse",
        "safe_embedding_lookup_sparse",
        "EmbeddingCollection",
        "GatheredRows",
        "PooledEmbeddings",
        "TableConfig",
        "JaggedTensor",
        "KeyedJaggedTensor",
        "SparseTensor",
        "RequestCounts",
        "count_requests",
    },
    "pstrain.data": {
        "AUTOTUNE",
        "INFINITE_CARDINALITY",
        "UNKNOWN_CARDINALITY",
        "Options",
        # TF's file datasets and tf.train.Example parsing
        "TextLineDataset",
        "TFRecordDataset",
        "TFRecordWriter",
        "FixedLenFeature",
        "VarLenFeature",
        "RaggedFeature",
        "parse_example",
        "parse_single_example",
        "decode_csv",
        # Keras' vocabulary lookups, for a dataset_fn's preprocessing (TF's PS tutorial)
        "StringLookup",
        "IntegerLookup",
        "Hashing",
        "HashedCrossing",
        "Discretization",
    },
    "pstrain.optimizers": {"RowWiseAdagrad", "apply_together"},  # one request per ps for several (issue 61)
    # what TF's embedding_lookup of ragged ids gives (its RaggedTensor of rows)
    "pstrain.nn": {"RaggedRows"},
    "pstrain.jax": {"PooledLookup", "pooled_lookup"},
    "pstrain.torch": {
        "EmbeddingBag",
        "EmbeddingBagCollection",
        "EmbeddingBagConfig",
        "KeyedTensor",
        "PoolingType",
        "table_configs",
        "DataType",  # TorchRec's, beside its EmbeddingBagConfig and PoolingType
        # TorchRec's unpooled lookups, for sequence features
        "EmbeddingCollection",
        "EmbeddingConfig",
        "JaggedTensor",
        # TorchRec's DLRM (torchrec.models.dlrm) and MLP (torchrec.modules.mlp)
        "DLRM",
        "DLRM_DCN",
        "DenseArch",
        "InteractionArch",
        "InteractionDCNArch",
        "LowRankCrossNet",
        "MLP",
        "OverArch",
        "Perceptron",
        "SparseArch",
        "choose",
    },
    # the untyped call, moved here from Channel.call (issue 62)
    "pstrain.testing": {"untyped_call"},
    # what a Keras user ports: the other schedules, initializers and metrics
    "pstrain.checkpoint": {"latest_checkpoint", "list_variables", "load_variable"},
    "pstrain.strings": {"fingerprint64", "to_hash_bucket_fast", "to_hash_bucket_strong"},
    "pstrain.metrics": {
        "BinaryAccuracy",
        "BinaryCrossentropy",
        "MeanAbsoluteError",
        "MeanSquaredError",
        "Precision",
        "Recall",
        "RootMeanSquaredError",
    },
    "pstrain.schedules": {"CosineDecayRestarts", "InverseTimeDecay", "PolynomialDecay"},
    "pstrain.initializers": {
        "GlorotNormal",
        "HeNormal",
        "HeUniform",
        "Identity",
        "LecunNormal",
        "LecunUniform",
        "Orthogonal",
        "VarianceScaling",
    },
}


@pytest.mark.parametrize("module", sorted(API))
def test_the_public_api_is_what_it_was(module):
    # pstrain.__all__ and each documented submodule's __all__, as recorded before the
    # modules moved into layer folders: moving code does not change what users import.
    mod = importlib.import_module(module)
    now = set(getattr(mod, "__all__", ["main"] if module == "pstrain.cli" else []))
    assert now - ADDED.get(module, set()) == set(API[module]), now ^ set(API[module])
    for name in API[module]:
        assert getattr(mod, name) is not None


def test_public_classes_report_their_public_module():
    for name in pstrain.__all__:
        obj = getattr(pstrain, name)
        if isinstance(obj, type):
            assert obj.__module__ == "pstrain" or obj.__module__ in API, (name, obj.__module__)
            assert not obj.__module__.startswith("pstrain._"), (name, obj.__module__)
    for module in API:
        mod = importlib.import_module(module)
        for name in API[module]:
            obj = getattr(mod, name)
            if isinstance(obj, type) and obj.__module__.startswith("pstrain"):
                assert "._" not in obj.__module__, f"{module}.{name} reports {obj.__module__}"
