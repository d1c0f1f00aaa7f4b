"""Cluster configuration: ClusterSpec, resolvers, TF_CONFIG / PSTRAIN_CONFIG, errors."""

from __future__ import annotations

import asyncio
import json

import pytest

import pstrain
from pstrain import errors
from pstrain.cluster import parse_address
from pstrain.errors import InvalidArgumentError

SPEC = {
    "chief": ["127.0.0.1:2220"],
    "ps": ["127.0.0.1:2221", "127.0.0.1:2222"],
    "worker": ["127.0.0.1:2223", "127.0.0.1:2224", "127.0.0.1:2225"],
}


def test_cluster_spec_basics():
    spec = pstrain.ClusterSpec(SPEC)
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 3 and spec.num_tasks("evaluator") == 0
    assert spec.task_address("ps", 1) == "127.0.0.1:2222"
    assert spec.as_dict() == SPEC
    assert pstrain.ClusterSpec(spec) == spec
    assert pstrain.ClusterSpec({"ps": {0: "h:1", 1: "h:2"}, "worker": ["h:3"]}).task_address("ps", 1) == "h:2"
    with pytest.raises(InvalidArgumentError, match="out of range"):
        spec.task_address("ps", 2)
    with pytest.raises(InvalidArgumentError, match="no job 'evaluator'"):
        spec.task_address("evaluator", 0)


@pytest.mark.parametrize("address", ["localhost", "host:", ":80", "h:99999", "h:port", "", 5])
def test_malformed_addresses(address):
    with pytest.raises(InvalidArgumentError, match="malformed address"):
        pstrain.ClusterSpec({"ps": [address], "worker": ["h:1"]})


def test_ipv6_address():
    assert parse_address("[::1]:2222") == ("::1", 2222)


def test_simple_resolver():
    r = pstrain.SimpleClusterResolver(pstrain.ClusterSpec(SPEC), task_type="worker", task_id=2, token="t")
    assert r.cluster_spec().num_tasks("ps") == 2 and r.task_type == "worker" and r.task_id == 2
    assert r.token == "t"
    with pytest.raises(InvalidArgumentError, match="Unrecognized task_type: foobar"):
        pstrain.SimpleClusterResolver(SPEC, task_type="foobar", task_id=0)


def test_tf_config_exactly_as_tf_documents_it(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 1}}))
    monkeypatch.setenv("PSTRAIN_TOKEN", "secret")
    r = pstrain.TFConfigClusterResolver()
    assert r.cluster_spec() == pstrain.ClusterSpec(SPEC)
    assert (r.task_type, r.task_id, r.token) == ("worker", 1, "secret")


def test_evaluator_and_pstrain_config_wins(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 1}}))
    mine = dict(SPEC, evaluator=["127.0.0.1:2226"])
    monkeypatch.setenv(
        "PSTRAIN_CONFIG", json.dumps({"cluster": mine, "task": {"type": "evaluator", "index": 0}})
    )
    r = pstrain.TFConfigClusterResolver()
    assert r.task_type == "evaluator" and r.cluster_spec().num_tasks("evaluator") == 1


def test_token_file(monkeypatch, tmp_path):
    (tmp_path / "token").write_text("from-file\n")
    monkeypatch.setenv("PSTRAIN_CONFIG", json.dumps({"cluster": SPEC}))
    monkeypatch.setenv("PSTRAIN_TOKEN_FILE", str(tmp_path / "token"))
    assert pstrain.TFConfigClusterResolver().token == "from-file"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"cluster": {"ps": ["h:1"]}}, "at least one worker"),
        ({"cluster": {"worker": ["h:1"]}}, "at least one ps"),
        ({"cluster": {"chief": ["h:1", "h:2"], "ps": ["h:3"], "worker": ["h:4"]}}, "at most one 'chief'"),
        ({"cluster": {"ps": ["h:1"], "worker": ["h:2"], "master": ["h:3"]}}, "Disallowed task type"),
        (
            {"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "foobar", "index": 0}},
            "Unrecognized task_type: foobar",
        ),
        (
            {"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 3}},
            "index 3 out of range",
        ),
        ({"cluster": {"ps": ["nocolon"], "worker": ["h:2"]}}, "malformed address"),
        ({"task": {"type": "worker"}}, "'cluster'"),
    ],
)
def test_invalid_configs_name_the_problem(monkeypatch, config, message):
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(InvalidArgumentError, match=message):
        pstrain.TFConfigClusterResolver()


def test_missing_and_malformed_config(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="PSTRAIN_CONFIG or TF_CONFIG"):
        pstrain.TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        pstrain.TFConfigClusterResolver()


def test_error_tree():

    for cls in (
        errors.UnavailableError,
        errors.CancelledError,
        errors.ClosureInputError,
        errors.InvalidArgumentError,
        errors.NotFoundError,
        errors.AlreadyExistsError,
        errors.AuthenticationError,
        errors.ProtocolError,
        errors.DeadlineExceededError,
    ):
        assert issubclass(cls, errors.PstrainError)
    assert issubclass(errors.UnavailableError, ConnectionError)
    assert issubclass(errors.DeadlineExceededError, TimeoutError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.NotFoundError, LookupError)

    assert not issubclass(errors.CancelledError, asyncio.CancelledError)
