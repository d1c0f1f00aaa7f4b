"""A tiered table against the same table kept wholly in RAM, under any sequence of what a
ps does to a shard: training lookups and updates (two requests in flight too), reads,
delta checkpoints (checked by composing them onto the last base), saves restored over the
live shard, slice moves between two shards (relayed, or pulled a block at a time), reads
staged off the handler, compactions and RAM given back. Two ps (A and B) each hold a
shard; every step is done to every world, and after every step each world's shards hold
the same rows, slots and lookups as the reference's (in RAM, every update finding its
rows again).

The eviction rules that decide by a row's own age or count (``max_age``, ``admit_after``)
must give the same rows in every world. Past a capacity a tiered shard chooses its victims
on disk first, so the rows it keeps may differ from those in RAM: a second machine checks
a tiered shard with a capacity against a model of the rows it holds."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pstrain._formats.messages.placement_map import SliceSet, TableCopy, TablePatch
from pstrain._formats.numerics.idhash import in_slices
from pstrain._formats.numerics.optimizer_rules import RULES
from pstrain.server.ps.store import ChangeClock
from pstrain.server.ps.tables.dynamic_table import DynamicTable
from pstrain.server.ps.tables.table_config import TableConfig
from pstrain.server.ps.tables.tiered_table import HOT_SHARE, TieredTable

pytestmark = pytest.mark.timeout(300)

SLICES = 4
DIM = 4
ADAGRAD = {"accumulator": ("acc", 0.1)}
CFG = {"kind": "adagrad", "learning_rate": 0.1, "epsilon": 1e-7}
ids_of = st.lists(st.integers(-60, 400), min_size=1, max_size=24, unique=True)


def tiered(directory: str, config: TableConfig, clock: ChangeClock, hot_rows: int) -> TieredTable:
    """A tiered shard whose budget's hot share keeps about ``hot_rows`` rows in RAM. The
    admission sightings (a few KiB, which a real budget covers many times over) are left
    out of what it holds: a budget this small would give them the hot set's room."""
    box: list[TieredTable] = []

    def held() -> int:
        if not box:
            return 0
        t = box[0]
        return t.nbytes - t._cand.nbytes - t._cand_counts.nbytes - t._cand_ids.nbytes

    table = TieredTable(
        "t",
        config,
        clock=clock,
        directory=directory,
        budget=1 << 40,
        held=held,
        segment_rows=8,
    )
    box.append(table)
    table.budget = int((held() - table.cold.nbytes + hot_rows * table.hot_row_bytes()) / HOT_SHARE)
    return table


def by_id(exported: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(exported["ids"], kind="stable")
    return {k: v[order] for k, v in exported.items()}


def gradient(ids: np.ndarray, t: int) -> np.ndarray:
    return np.sin(np.outer(ids + t, np.arange(1, DIM + 1)) * 0.01).astype(np.float32)


def read(snapshots: dict[str, Any]) -> dict[str, np.ndarray]:
    empty = {k: s.array[:0] for k, s in snapshots.items()}  # (a shard without rows: no block)
    return {k: np.concatenate([empty[k], *s.blocks()]) for k, s in snapshots.items()}


def slots(saved: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.removeprefix("slot:"): v for k, v in saved.items() if k.startswith("slot:")}


class Probing(DynamicTable):
    """A shard in RAM whose updates find their rows again (no rows kept from the lookup
    before): what the other shards' updates must agree with."""

    def locate_update(self, ids: np.ndarray) -> np.ndarray | None:
        return self.locate(np.ascontiguousarray(ids, np.int64))


class Shards:
    """One world: shard A and shard B of one table, and which slices each owns."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.clocks = {"A": ChangeClock(), "B": ChangeClock()}
        self.shards = {p: make(p, self.clocks[p]) for p in "AB"}
        self.owned = {"A": [0, 1, 2, 3], "B": []}
        self.bases: dict[str, tuple[int, dict[str, np.ndarray]]] = {}

    def route(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {p: ids[in_slices(ids, SLICES, self.owned[p])] for p in "AB"}

    def train(self, ids: np.ndarray, t: int) -> dict[str, np.ndarray]:
        out = self.look(ids, True)
        self.update(ids, t)
        return out

    def look(self, ids: np.ndarray, train: bool) -> dict[str, np.ndarray]:
        """A lookup as the ps serves it: the ids' rows found first (``locate``)."""
        out = {}
        for p, mine in self.route(ids).items():
            if mine.size:
                shard = self.shards[p]
                out[p] = shard.lookup(mine, train, shard.locate(mine))
        return out

    def update(self, ids: np.ndarray, t: int) -> None:
        """An update as the ps applies it: the rows its training lookup found, if it was
        one of the last few and nothing left the table since (``locate_update``)."""
        for p, mine in self.route(ids).items():
            if mine.size:
                shard = self.shards[p]
                shard.apply(
                    RULES["adagrad"], mine, gradient(mine, t), ADAGRAD, CFG, t, shard.locate_update(mine)
                )

    def lookup(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return self.look(ids, False)

    def export(self, p: str) -> dict[str, np.ndarray]:
        return by_id(self.shards[p].export())

    def mark_base(self, p: str) -> None:
        """A full save of shard ``p`` now: the base the next delta composes onto."""
        self.bases[p] = (self.clocks[p].mark(), self.export(p))

    def delta_composes(self, p: str) -> dict[str, np.ndarray] | None:
        """The last base of ``p`` with the delta since it applied (None: the shard kept no
        full record of its evictions: the next save must be full); the delta becomes the
        new base."""
        mark, base = self.bases[p]
        got = self.shards[p].changes(mark)
        if got is None:
            return None
        save, gone = got
        changed = read(save)
        self.shards[p].end_snapshot(save)
        rows = {int(i): k for k, i in enumerate(base["ids"])}
        keep = np.ones(base["ids"].size, bool)
        for i in gone:
            if int(i) in rows:
                keep[rows[int(i)]] = False
        stale = np.isin(base["ids"], changed["ids"])
        for key in changed.keys() - base.keys():  # a slot made since the base: rows had its initial value
            base[key] = np.full((base["ids"].size, DIM), 0.1, np.float32)
        composed = {k: np.concatenate([base[k][keep & ~stale], changed[k]]) for k in changed if k != "live"}
        self.bases[p] = (self.clocks[p].mark(), self.export(p))
        return by_id(composed)

    def move(self, slices: list[int], src: str, dst: str, between: Any, pulled: bool = False) -> None:
        """Slices ``slices`` of ``src`` to ``dst`` as a move does: a copy, training on the
        source meanwhile (``between``), a patch since the copy's mark, the merge, the drop.
        ``pulled`` (tiered shards): the copy streamed a few rows at a time into the
        receiver's disk, as ``ps/move_records`` pulls it, the training halfway through."""
        moving = SliceSet(slices=SLICES, owned=slices)
        source, receiver = self.shards[src], self.shards[dst]
        if not pulled:
            copy = TableCopy(**source.copy_slices(moving))
            mark = self.clocks[src].mark()
            between()
            patch = TablePatch(**source.patch_slices(moving, mark))
            receiver.merge_slices(copy, patch)
        else:
            fields, stream = source.stream_copy(moving)
            mark = self.clocks[src].mark()
            sink, got, trained = receiver.pull_sink("t"), 0, False
            while got < stream.size:
                if not trained and got >= stream.size // 2:
                    between()
                    trained = True
                raw, carried = stream.read(got, stream.size - got, max_bytes=3 * stream.record.itemsize)
                records = sink.checked(raw, list(carried))
                sink.put(records, list(carried))
                got += records.size
            if not trained:
                between()
            patch = TablePatch(**source.patch_slices(moving, mark))
            receiver.checked_merge(TableCopy(**fields), patch, pulled=sink)()
            stream.close()
        source.drop_slices(moving)
        self.owned[src] = [s for s in self.owned[src] if s not in slices]
        self.owned[dst] = sorted(self.owned[dst] + slices)
        self.bases.pop(src, None)  # (a move is not an eviction: the next save is full)
        self.bases.pop(dst, None)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """``np.testing.assert_array_equal``, checked first as the same bytes: the machines
    compare hundreds of thousands of small arrays, and numpy's comparison, which the same
    bytes would pass, costs some 50 us each (its bytes, under 1 us)."""
    if got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes():
        return
    np.testing.assert_array_equal(got, want, err_msg=what)


#: What both machines run under: 40 steps a sequence, as long as each takes.
MACHINES = {
    "stateful_step_count": 40,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}


@settings(max_examples=300, **MACHINES)
class TieredAgainstRam(RuleBasedStateMachine):
    """Three worlds: ``probing`` (in RAM, every update finds its rows again: the
    reference), ``ram`` (in RAM, as a ps runs it) and ``disk`` (tiered)."""

    @initialize(
        max_age=st.sampled_from([None, 2, 9]),
        admit_after=st.sampled_from([None, 2]),
        hot_rows=st.sampled_from([24, 48]),
        evict=st.sampled_from(["lru", "lfu"]),  # (with no capacity: what picks the hot set)
    )
    def start(self, max_age: int | None, admit_after: int | None, hot_rows: int, evict: str) -> None:
        self.config = TableConfig(dim=DIM, max_age=max_age, admit_after=admit_after, evict=evict)
        self.dir = tempfile.mkdtemp(prefix="pstrain-tiered-state-")
        self.n_restores = 0
        self.probing = Shards(lambda p, clock: Probing("t", self.config, clock=clock))
        self.ram = Shards(lambda p, clock: DynamicTable("t", self.config, clock=clock))
        self.disk = Shards(
            lambda p, clock: tiered(f"{self.dir}/{p}-{self.n_restores}", self.config, clock, hot_rows)
        )
        self.worlds = {"probing": self.probing, "ram": self.ram, "disk": self.disk}
        self.t = 0

    def teardown(self) -> None:
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _all(self, what: str, *args: Any) -> dict[str, Any]:
        return {name: getattr(world, what)(*args) for name, world in self.worlds.items()}

    def _same(self, got: dict[str, Any], what: str) -> None:
        """Each world's ``got`` (shard -> array, or None) as the reference's."""
        want = got["probing"]
        for name, value in got.items():
            if want is None or value is None:
                assert (want is None) == (value is None), f"{what}: {name}"
                continue
            assert value.keys() == want.keys(), f"{what}: {name}"
            for key in want:
                same(value[key], want[key], f"{what}: {name}, {key}")

    @rule(ids=ids_of)
    def train(self, ids: list[int]) -> None:
        self.t += 1
        self._same(self._all("train", np.array(ids, np.int64), self.t), "training lookup")

    @rule(ids=ids_of)
    def lookup(self, ids: list[int]) -> None:
        self._same(self._all("lookup", np.array(ids, np.int64)), "lookup")

    @rule(first=ids_of, second=ids_of)
    def interleaved(self, first: list[int], second: list[int]) -> None:
        """Two requests' lookups, then their updates the other way round (two steps in
        flight): the second lookup may move, expire or create rows under the first."""
        x, y = np.array(first, np.int64), np.array(second, np.int64)
        self._same(self._all("look", x, True), "first lookup")
        self._same(self._all("look", y, True), "second lookup")
        self._all("update", y, self.t + 1)
        self._all("update", x, self.t + 2)
        self.t += 2

    @rule(p=st.sampled_from("AB"))
    def base(self, p: str) -> None:
        self._all("mark_base", p)

    @rule(p=st.sampled_from("AB"))
    def delta(self, p: str) -> None:
        """The delta since the last base, composed onto it, is the shard now."""
        if p not in self.probing.bases:
            return
        composed = self._all("delta_composes", p)
        for name, got in composed.items():
            if got is not None:
                live = self.worlds[name].export(p)
                for key in live:
                    same(got[key], live[key], f"delta of {p}: {name}, {key}")
        self._same(composed, f"delta of {p}")

    @rule(p=st.sampled_from("AB"), ids=ids_of)
    def restore(self, p: str, ids: list[int]) -> None:
        """A save of shard ``p``, training on (which the restore undoes), then the save
        restored over the live shard, as a ps restores a checkpoint."""
        saved = {}
        for name, world in self.worlds.items():
            shard = world.shards[p]
            snap = shard.snapshot()
            world.train(np.array(ids, np.int64), self.t + 1)
            arrays = read(snap)
            shard.end_snapshot(snap)
            live = arrays.pop("live").astype(bool)
            saved[name] = by_id({k: v[live] for k, v in arrays.items()})
        self.t += 1
        self.n_restores += 1
        self._same({name: {"": got["rows"]} for name, got in saved.items()}, "saved rows")
        for name, world in self.worlds.items():
            got = saved[name]
            if world is self.disk:
                restored = world.make(p, world.clocks[p])
                restored.load(got["ids"], got["rows"], slots(got), {"acc": 0.1}, replacing=world.shards[p])
                world.shards[p] = restored
            else:
                world.shards[p].load(got["ids"], got["rows"], slots(got), {"acc": 0.1})
            world.bases.pop(p, None)

    @rule(data=st.data(), ids=ids_of)
    def move(self, data: Any, ids: list[int]) -> None:
        owned = self.probing.owned
        src = "A" if owned["A"] else "B"
        if owned["B"] and data.draw(st.booleans(), label="from B"):
            src = "B"
        dst = "B" if src == "A" else "A"
        slices = data.draw(st.lists(st.sampled_from(owned[src]), min_size=1, unique=True), label="slices")
        pulled = data.draw(st.booleans(), label="pulled")
        self.t += 1
        t = self.t
        for world in self.worlds.values():
            world.move(
                slices,
                src,
                dst,
                lambda w=world: w.train(np.array(ids, np.int64), t),
                world is self.disk and pulled,
            )

    @rule(ids=ids_of, meanwhile=ids_of)
    def staged_train(self, ids: list[int], meanwhile: list[int]) -> None:
        """A request whose rows on disk are read before its handler runs (a ps's stage, the
        read on a thread), with another request trained while it reads, then trained."""
        batch = np.array(ids, np.int64)
        promotions = []
        for p, mine in self.disk.route(batch).items():
            shard = self.disk.shards[p]
            if not mine.size or not len(shard.cold):
                continue
            found = shard.in_ram(mine)
            cold_ids, slots, places = shard.cold_found(mine[found.pos < 0])
            records = shard.read_cold(places)
            promotions.append(
                lambda s=shard, c=cold_ids, k=slots, at=places, r=records, m=mine, f=found: s.promote(
                    c, k, at, r, m, f
                )
            )
        self.train(meanwhile)
        for promote in promotions:
            promote()
        self.train(ids)

    @rule(p=st.sampled_from("AB"), meanwhile=ids_of)
    def compact(self, p: str, meanwhile: list[int]) -> None:
        """A half-dead segment of shard ``p``'s disk copied to the end a few rows at a time
        (as ``TableHandlers.compact``: each part read on a thread), a request trained
        halfway (it may take rows of the segment back, or send others out)."""
        shard = self.disk.shards[p]
        number = shard.cold.compactable()
        if number is None:
            return
        slots, places = shard.cold.live_in(number)
        for lo in range(0, slots.size, 3):
            part, at = slots[lo : lo + 3], places[lo : lo + 3]
            still = shard.cold.current(part, at)
            part, at = part[still], at[still]
            if not part.size:
                continue
            records = shard.cold.read(at, dict(shard.slot_init))
            if lo <= slots.size // 2 < lo + 3:
                self.train(meanwhile)
            shard.cold.rewrite(part, at, records)

    @rule(p=st.sampled_from("AB"), share=st.sampled_from([0.25, 0.5, 1.0]))
    def give_back(self, p: str, share: float) -> None:
        """Shard ``p`` gives RAM to another table on its ps: its coldest rows go to disk,
        its arrays get smaller. Nothing a lookup reads changes."""
        shard = self.disk.shards[p]
        shard.give_back(int(share * shard.alloc * shard.hot_row_bytes()))

    @invariant()
    def same_rows(self) -> None:
        if not hasattr(self, "worlds"):
            return
        for p in "AB":
            self._same({name: world.export(p) for name, world in self.worlds.items()}, f"shard {p}")
            disk = self.disk.shards[p]
            stats = disk.statistics()
            assert stats["hot_rows"] + stats["cold_rows"] == len(disk) == len(self.probing.shards[p])


TestTieredAgainstRam = TieredAgainstRam.TestCase


@settings(max_examples=200, **MACHINES)
class TieredWithCapacity(RuleBasedStateMachine):
    """A tiered shard with a capacity (it evicts, from disk first) against a model of its
    rows: every row it holds is the model's (the row it gave when the id came in, then
    every update, in numpy), it never holds more than its capacity, never evicts an id of
    the request it serves, and its deltas composed onto their base are the shard."""

    @initialize(
        capacity=st.sampled_from([60, 150]),
        max_age=st.sampled_from([None, 5]),
        hot_rows=st.sampled_from([24, 48]),
        evict=st.sampled_from(["lru", "lfu"]),
    )
    def start(self, capacity: int, max_age: int | None, hot_rows: int, evict: str) -> None:
        self.config = TableConfig(dim=DIM, capacity=capacity, max_age=max_age, evict=evict)
        self.dir = tempfile.mkdtemp(prefix="pstrain-tiered-capacity-")
        self.clock = ChangeClock()
        self.shard = tiered(self.dir, self.config, self.clock, hot_rows)
        self.model: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id -> (row, accumulator)
        self.base: tuple[int, dict[str, np.ndarray]] | None = None
        self.t = 0

    def teardown(self) -> None:
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _forget_evicted(self, serving: np.ndarray) -> None:
        held = set(self.shard.export()["ids"].tolist())
        gone = set(self.model) - held
        assert not gone & set(serving.tolist()), "an id of the request being served was evicted"
        for i in gone:
            del self.model[i]

    @rule(ids=ids_of)
    def train(self, ids: list[int]) -> None:
        self.t += 1
        batch = np.array(ids, np.int64)
        out = self.shard.lookup(batch, True, self.shard.locate(batch))
        self._forget_evicted(batch)
        for i, row in zip(ids, out):
            if i in self.model:
                same(row, self.model[i][0], f"row of {i}")
            else:
                self.model[i] = (row.copy(), np.full(DIM, 0.1, np.float32))
        grad = gradient(batch, self.t)
        self.shard.apply(RULES["adagrad"], batch, grad, ADAGRAD, CFG, self.t, self.shard.locate_update(batch))
        rows = np.stack([self.model[i][0] for i in ids])
        acc = np.stack([self.model[i][1] for i in ids])
        RULES["adagrad"](rows, grad, np.arange(len(ids), dtype=np.int64), {"accumulator": acc}, CFG, self.t)
        for k, i in enumerate(ids):
            self.model[i] = (rows[k], acc[k])

    @rule()
    def base_save(self) -> None:
        self.base = (self.clock.mark(), by_id(self.shard.export()))

    @rule()
    def delta(self) -> None:
        if self.base is None:
            return
        mark, base = self.base
        got = self.shard.changes(mark)
        if got is None:  # (its evictions were not all kept: the next save is a full one)
            self.base = None
            return
        save, gone = got
        changed = read(save)
        self.shard.end_snapshot(save)
        for key in changed.keys() - base.keys():
            base[key] = np.full((base["ids"].size, DIM), 0.1, np.float32)
        keep = ~np.isin(base["ids"], gone) & ~np.isin(base["ids"], changed["ids"])
        composed = by_id({k: np.concatenate([base[k][keep], changed[k]]) for k in changed if k != "live"})
        live = by_id(self.shard.export())
        for key in live:
            same(composed[key], live[key], f"delta: {key}")
        self.base = (self.clock.mark(), live)

    @rule(share=st.sampled_from([0.5, 1.0]))
    def give_back(self, share: float) -> None:
        self.shard.give_back(int(share * self.shard.alloc * self.shard.hot_row_bytes()))

    @invariant()
    def as_the_model(self) -> None:
        if not hasattr(self, "shard"):
            return
        assert len(self.shard) <= self.config.capacity
        live = self.shard.export()
        assert set(live["ids"].tolist()) <= set(self.model)
        for i, row, acc in zip(
            live["ids"].tolist(), live["rows"], live.get("slot:acc", [None] * len(live["ids"]))
        ):
            same(row, self.model[i][0], f"row of {i}")
            if acc is not None:
                same(acc, self.model[i][1], f"accumulator of {i}")
        stats = self.shard.statistics()
        assert stats["hot_rows"] + stats["cold_rows"] == len(self.shard)


TestTieredWithCapacity = TieredWithCapacity.TestCase
