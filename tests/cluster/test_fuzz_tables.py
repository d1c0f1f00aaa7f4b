"""Property-based fuzzing of the dynamic tables' operations against real ps, one that keeps
every row in RAM and one that tiers its rows to disk.

Properties: a ps answers every table request with a result or a pstrain error that is not
an internal error, and stays up; a refused request changes no row of any table; and a
tiered ps answers every sequence of table requests (lookups, training or not, updates of
every optimizer, a table given twice) as the ps that keeps everything in RAM does, row for
row, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pstrain import rpc
from pstrain._transport.bridge import new_event_loop
from pstrain.errors import InvalidArgumentError, PstrainError
from pstrain.server.ps import ParameterServer
from pstrain.testing import untyped_call

pytestmark = pytest.mark.timeout(240)

TOKEN = "fuzz-token"
DIM = 4
ADAGRAD = {"kind": "adagrad", "learning_rate": 0.1}
#: Rows each table starts with (most of them on disk on the tiered ps).
FILLED = 20_000


@contextlib.contextmanager
def serving(
    tmp_path, tiered: list[bool], budget: int = 1 << 20
) -> Iterator[tuple[Any, list[Any], list[Any]]]:
    """ps (tiered or not, each as ``tiered`` says) on one loop, with a channel to each."""
    loop = new_event_loop()
    servers = [
        ParameterServer(
            i,
            token=TOKEN,
            checkpoint_root=str(tmp_path / f"ps{i}"),
            **(
                {"memory_budget": budget, "table_dir": str(tmp_path / f"tier{i}"), "table_segment_rows": 64}
                if t
                else {}
            ),
        )
        for i, t in enumerate(tiered)
    ]
    channels: list[Any] = []

    async def start() -> None:
        for i, server in enumerate(servers):
            await server.start()
            channels.append(rpc.Channel(server.address, token=TOKEN, task=f"ps{i}"))

    try:
        loop.run_until_complete(start())
        yield loop, servers, channels
    finally:
        for ch in channels:
            loop.run_until_complete(ch.close())
        for server in servers:
            loop.run_until_complete(server.stop())
        loop.run_until_complete(rpc.close_loop_channels())
        loop.close()
        asyncio.set_event_loop(None)


async def answer(ch: Any, op: str, payload: dict[str, Any]) -> tuple[str, Any]:
    """``("ok", reply)``, or the error's class and message."""
    try:
        return "ok", await untyped_call(ch, op, payload, timeout=60)
    except PstrainError as exc:
        return type(exc).__name__, str(exc)


async def fill(ch: Any) -> None:
    """Tables ``t`` (FILLED rows trained once) and ``u`` (LFU, a capacity, empty)."""
    await untyped_call(ch, "dyn/create", {"name": "t", "config": {"dim": DIM}})
    await untyped_call(
        ch, "dyn/create", {"name": "u", "config": {"dim": DIM, "evict": "lfu", "capacity": 3000}}
    )
    for lo in range(0, FILLED, 500):
        ids = np.arange(lo, lo + 500, dtype=np.int64)
        await untyped_call(ch, "dyn/lookup", {"name": "t", "ids": ids, "train": True})
        grad = np.full((500, DIM), 0.1, np.float32)
        await untyped_call(
            ch, "opt/apply", {"rule": ADAGRAD, "prefix": "opt", "grads": [], "tables": [("t", ids, grad)]}
        )


async def rows_of(ch: Any) -> list[Any]:
    """Every table's rows and slots, by id (not its statistics, which count reads too)."""
    out = []
    for name in ("t", "u"):
        kind, got = await answer(ch, "dyn/export", {"name": name})
        if kind != "ok":
            out.append(kind)
            continue
        order = np.argsort(got["ids"])
        slots = {k: v[order].tobytes() for k, v in sorted(got["slots"].items())}
        out.append((got["ids"][order].tobytes(), got["rows"][order].tobytes(), slots, got["slot_init"]))
    return out


# -- requests: right and wrong parts mixed --------------------------------------------------------
names = st.sampled_from(["t", "t", "u", "missing", "", "w", "t" * 1024])
garbage = st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=3), st.binary(max_size=3))
id_values = st.lists(
    st.one_of(st.integers(0, FILLED), st.integers(FILLED, 10**6), st.integers(-3, -1), st.just(2**63 - 1)),
    max_size=12,
)


def _ids(dtype: str, values: list[int], two_d: bool) -> np.ndarray:
    arr = np.array(values, np.int64).astype(dtype) if values else np.zeros(0, dtype)
    return arr.reshape(-1, 1) if two_d and arr.size else arr


any_ids = st.builds(
    _ids, st.sampled_from(["<i8", "<u8", "<i4", "<f8", "|b1", "<c8", ">i8", "|u1"]), id_values, st.booleans()
)


def _grad(ids: np.ndarray, shape: str, dtype: str, fill: float) -> np.ndarray:
    n = ids.shape[0] if ids.ndim else 1
    dims = {"match": (n, DIM), "wide": (n, DIM + 1), "flat": (n,), "3-D": (n, DIM, 1)}[shape]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.full(dims, fill).astype(dtype)


any_grads = st.lists(
    st.builds(
        lambda n, i, s, d, f: (n, i, _grad(i, s, d, f)),
        names,
        any_ids,
        st.sampled_from(["match", "match", "wide", "flat", "3-D"]),
        st.sampled_from(["<f4", "<f8", "<i4", "<f2", "|b1"]),
        st.sampled_from([0.1, float("nan"), float("inf"), -1e30]),
    ),
    max_size=3,
)
any_rule = st.one_of(
    st.just(ADAGRAD),
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["sgd", "adam", "ftrl", "rowwise_adagrad", "nope"]),
            "learning_rate": st.floats(-1, 1),
        }
    ),
)
any_config = st.fixed_dictionaries(
    {"dim": st.integers(-1, 6)},
    optional={
        "dtype": st.sampled_from(["float32", "float64", "int32", "x", "i4,f4"]),
        "capacity": st.integers(-1, 100),
        "evict": st.sampled_from(["lru", "lfu", "x"]),
        "init_low": st.floats(),
        "init_high": st.floats(),
    },
)
any_request = st.one_of(
    st.tuples(
        st.just("dyn/lookup"),
        st.fixed_dictionaries(
            {"name": st.one_of(names, garbage), "ids": st.one_of(any_ids, garbage), "train": st.booleans()}
        ),
    ),
    st.tuples(
        st.just("dyn/lookup_many"),
        st.fixed_dictionaries(
            {
                "lookups": st.lists(st.fixed_dictionaries({"name": names, "ids": any_ids}), max_size=3),
                "train": st.booleans(),
            },
            optional={
                "reads": st.lists(
                    st.fixed_dictionaries({"name": names}, optional={"indices": any_ids}), max_size=2
                )
            },
        ),
    ),
    st.tuples(
        st.just("opt/apply"),
        st.fixed_dictionaries(
            {
                "rule": any_rule,
                "prefix": st.sampled_from(["opt", "other", ""]),
                "grads": st.just([]),
                "tables": any_grads,
            },
            optional={"unique_rows": st.booleans(), "t": st.integers(-2, 5)},
        ),
    ),
    st.tuples(
        st.just("dyn/create"),
        st.fixed_dictionaries(
            {"name": names, "config": any_config},
            optional={"shard": st.integers(-1, 3), "num_shards": st.integers(0, 4), "owned": garbage},
        ),
    ),
    st.tuples(
        st.sampled_from(["dyn/export", "dyn/stats"]),
        st.fixed_dictionaries({"name": st.one_of(names, garbage)}),
    ),
    st.tuples(
        st.just("dyn/restore"),
        st.fixed_dictionaries(
            {
                "name": names,
                "config": st.just({"dim": DIM}),
                "paths": st.lists(
                    st.sampled_from(["/etc/passwd", "x", "../x", "/nonexistent/t", ""]), max_size=2
                ),
                "shard": st.integers(0, 2),
                "num_shards": st.integers(1, 3),
                "deltas": st.just([]),
            }
        ),
    ),
)


# the moves' and saves' operations on tables ("{root}": the ps's checkpoint root; "{self}":
# its incarnation, which a delta names)
slice_sets = st.one_of(
    garbage,
    st.fixed_dictionaries(
        {"slices": st.integers(-1, 70_000), "owned": st.lists(st.integers(-2, 70_000), max_size=4)}
    ),
)
stages = st.sampled_from(["s1", "s2", "", "x" * 70])
in_root = st.sampled_from(["{root}/c1", "{root}/c1/t", "{root}/c3/u", "{root}/c1/../../x", "../c", "/tmp/x"])
move_or_save = st.one_of(
    st.tuples(
        st.just("ps/move_out"),
        st.fixed_dictionaries(
            {
                "keys": st.lists(names, max_size=2),
                "stage": stages,
                "tables": st.dictionaries(names, slice_sets, max_size=2),
                "pull_records": st.booleans(),
            }
        ),
    ),
    st.tuples(
        st.just("ps/move_records"),
        st.fixed_dictionaries(
            {
                "stage": stages,
                "name": names,
                "start": st.integers(-1, FILLED),
                "count": st.integers(0, 1 << 25),
                "max_bytes": st.integers(0, 1 << 31),
            }
        ),
    ),
    st.tuples(st.just("ps/move_end"), st.fixed_dictionaries({"stage": stages, "commit": st.booleans()})),
    st.tuples(
        st.just("ps/move_pull"),  # from nothing that answers, on loopback
        st.fixed_dictionaries(
            {
                "stage": stages,
                "source_index": st.integers(-1, 3),
                "source_address": st.sampled_from(["127.0.0.1:1", "x"]),
                "keys": st.lists(names, max_size=2),
                "tables": st.dictionaries(names, slice_sets, max_size=2),
                "serving": st.dictionaries(names, slice_sets, max_size=2),
                "capacity": st.dictionaries(names, st.integers(-1, 10), max_size=2),
                "timeout": st.sampled_from([0.5, -1.0]),
            }
        ),
    ),
    st.tuples(st.just("ps/records"), st.fixed_dictionaries({"names": st.lists(names, max_size=3)})),
    st.tuples(
        st.just("ckpt/save"),
        st.fixed_dictionaries(
            {
                "path": in_root,
                "tensors": st.just({}),
                "tables": st.lists(
                    st.fixed_dictionaries(
                        {"name": names, "path": in_root},
                        optional={
                            "slots": st.dictionaries(
                                st.sampled_from(["opt/accumulator", "x"]), names, max_size=2
                            )
                        },
                    ),
                    max_size=2,
                ),
            }
        ),
    ),
    st.tuples(st.just("delta/mark"), st.just({})),
    st.tuples(
        st.just("delta/save"),
        st.fixed_dictionaries(
            {
                "path": in_root,
                "since": st.integers(-1, 5),
                "incarnation": st.sampled_from(["", "abc", "{self}"]),
                "variables": st.just({}),
                "tables": st.dictionaries(
                    names,
                    st.fixed_dictionaries(
                        {"prefix": st.sampled_from(["p", ""])},
                        optional={
                            "slots": st.dictionaries(
                                st.sampled_from(["opt/accumulator", "x"]), names, max_size=1
                            )
                        },
                    ),
                    max_size=2,
                ),
                "write_s": st.sampled_from([0.0, 1.0, -1.0]),
            }
        ),
    ),
)


def _placed(value: Any, fill_in: dict[str, str]) -> Any:
    """``value`` with each string's ``{root}`` and ``{self}`` filled in."""
    if isinstance(value, str):
        for key, text in fill_in.items():
            value = value.replace("{" + key + "}", text)
        return value
    if isinstance(value, dict):
        return {_placed(k, fill_in): _placed(v, fill_in) for k, v in value.items()}
    if isinstance(value, list):
        return [_placed(v, fill_in) for v in value]
    return value


@pytest.mark.parametrize("tiered", [False, True], ids=["in RAM", "tiered"])
def test_every_table_operation_validates_whatever_it_is_sent(tmp_path, tiered):
    outcomes = {"ok": 0, "refused": 0}
    with serving(tmp_path, [tiered]) as (loop, servers, (ch,)):
        loop.run_until_complete(fill(ch))
        for directory in ("c1", "c3"):
            (tmp_path / "ps0" / directory).mkdir(parents=True)
        fill_in = {"root": str(tmp_path / "ps0"), "self": servers[0].incarnation}

        @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(st.one_of(any_request, move_or_save))
        def one(request):
            op, payload = request[0], _placed(request[1], fill_in)
            before = loop.run_until_complete(rows_of(ch))
            kind, said = loop.run_until_complete(answer(ch, op, payload))
            if kind == "ok":
                outcomes["ok"] += 1
                return
            outcomes["refused"] += 1
            assert "internal error" not in said and kind != "PstrainError", (op, payload, said)
            assert loop.run_until_complete(rows_of(ch)) == before, (op, payload, said)  # nothing changed

        one()
        assert servers[0].internal_errors == 0 and servers[0].status.value == "running"
        assert outcomes["refused"] > 500 and outcomes["ok"] > 50, outcomes  # both sides reached


# -- a tiered ps against one in RAM: requests mostly right -------------------------------------------
tables = st.sampled_from(["t", "t", "t", "u", "missing"])
some_ids = st.builds(
    lambda values, distinct: (
        np.unique(np.array(values, np.int64)) if distinct else np.array(values, np.int64)
    ),
    st.lists(
        st.one_of(
            st.integers(0, FILLED),
            st.integers(0, FILLED),
            st.integers(FILLED, FILLED + 3000),
            st.integers(-3, -1),
        ),
        max_size=40,
    ),
    st.booleans(),
)
rules = st.one_of(
    st.just(ADAGRAD),
    st.builds(
        lambda kind, rate: {"kind": kind, "learning_rate": rate},
        st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]),
        st.sampled_from([0.01, 0.5]),
    ),
)
table_requests = st.one_of(
    st.builds(
        lambda n, i, t: ("dyn/lookup", {"name": n, "ids": i, "train": t}), tables, some_ids, st.booleans()
    ),
    st.builds(
        lambda lookups, t: (
            "dyn/lookup_many",
            {"lookups": [{"name": n, "ids": i} for n, i in lookups], "train": t},
        ),
        st.lists(st.tuples(tables, some_ids), min_size=1, max_size=3),
        st.booleans(),
    ),
    st.builds(
        lambda rule, prefix, parts: (
            "opt/apply",
            {
                "rule": rule,
                "prefix": prefix,
                "grads": [],
                # a table may come twice: its parts are applied in turn
                "tables": [(n, i, np.full((i.size, DIM + wide), g, np.float32)) for n, i, wide, g in parts],
            },
        ),
        rules,
        st.sampled_from(["opt", "opt", "opt2"]),
        st.lists(
            st.tuples(
                tables, some_ids, st.sampled_from([0, 0, 0, 1]), st.sampled_from([0.1, -0.2, float("nan")])
            ),
            min_size=1,
            max_size=3,
        ),
    ),
)


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != "ok" or b[0] != "ok":  # both refused (which of two faults is named may differ)
        return a[0] != "ok" and b[0] != "ok"
    values = [r.get("values") for r in (a[1], b[1])]  # (untyped: the reply's fields)
    if values[0] is None:
        return values[1] is None and a[1].keys() == b[1].keys()
    return [v.tobytes() for v in values[0]] == [v.tobytes() for v in values[1]]


def test_a_tiered_ps_answers_every_table_request_as_one_in_ram(tmp_path):
    # A budget under the tables' rows (most of t on disk), over what any one request needs:
    # the tiered ps refuses nothing the other serves.
    with serving(tmp_path, [False, True]) as (loop, servers, channels):
        for ch in channels:
            loop.run_until_complete(fill(ch))
        tier = servers[1].tables["t"]
        assert len(tier.cold) > FILLED // 2

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(st.lists(table_requests, min_size=1, max_size=6))
        def steps(requests):
            for op, payload in requests:
                ram, tiered = (loop.run_until_complete(answer(ch, op, payload)) for ch in channels)
                assert _same(ram, tiered), (op, payload, ram, tiered)
            ram_rows, tiered_rows = (loop.run_until_complete(rows_of(ch)) for ch in channels)
            assert tiered_rows == ram_rows, requests

        steps()
        assert [s.internal_errors for s in servers] == [0, 0]
        assert tier.statistics()["promoted"] > 0 and tier.statistics()["refused"] == 0
        assert servers[1].table_handlers.held() <= servers[1].table_handlers.tiering.budget


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"dim": 4, "dtype": "x"}, "dtype must be float32 or float64, got 'x'"),
        ({"dim": 4, "dtype": "int32"}, "dtype must be float32 or float64, got int32"),
        ({"dim": 4, "init_low": float("-inf")}, "bounds must be finite numbers"),
        ({"dim": 4, "init_high": float("nan")}, "bounds must be finite numbers"),
    ],
)
def test_a_table_of_a_config_no_table_can_have_is_refused_naming_it(tmp_path, config, message):
    with serving(tmp_path, [False, True]) as (loop, servers, channels):
        for ch in channels:
            with pytest.raises(InvalidArgumentError, match=message):
                loop.run_until_complete(untyped_call(ch, "dyn/create", {"name": "t", "config": config}))
        assert [s.internal_errors for s in servers] == [0, 0] and not any(s.tables for s in servers)


def test_a_tiered_table_of_the_longest_name_keeps_its_rows_on_disk(tmp_path):
    # A name may be 1,024 characters (three times that once quoted for a file name, where
    # 255 bytes is the most): the tier's directory takes a part of it.
    name = "é/" * 512
    with serving(tmp_path, [True], budget=256 << 10) as (loop, servers, (ch,)):
        loop.run_until_complete(untyped_call(ch, "dyn/create", {"name": name, "config": {"dim": DIM}}))
        for lo in range(0, 4000, 250):
            ids = np.arange(lo, lo + 250, dtype=np.int64)
            loop.run_until_complete(untyped_call(ch, "dyn/lookup", {"name": name, "ids": ids, "train": True}))
        table = servers[0].tables[name]
        assert len(table.cold) > 1000 and servers[0].internal_errors == 0
        got = loop.run_until_complete(untyped_call(ch, "dyn/export", {"name": name}))
        assert np.array_equal(np.sort(got["ids"]), np.arange(4000))
