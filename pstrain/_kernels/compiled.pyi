"""Types of the compiled kernels (compiled.pyx); see pstrain._kernels.reference."""

import numpy as np

def index_get(slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> None: ...
def index_insert(slots: np.ndarray, size: int, ids: np.ndarray, rows: np.ndarray) -> None: ...
def index_refind(slots: np.ndarray, size: int, ids: np.ndarray, pos: np.ndarray) -> None: ...
def absent(ids: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
def same_ids(a: np.ndarray, b: np.ndarray) -> bool: ...
def index_locate(
    slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray, mark: np.ndarray
) -> bool: ...
def index_delete(slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> int: ...
def compact_get(keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> None: ...
def compact_insert(
    keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, rows: np.ndarray
) -> None: ...
def compact_delete(
    keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray
) -> int: ...
def sgd_rows(var: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float) -> None: ...
def adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None: ...
def rowwise_adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None: ...
def bag_positions(offsets: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray) -> np.ndarray: ...
def take_bags(
    values: np.ndarray, itemsize: int, offsets: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray
) -> np.ndarray: ...
def take_keyed_bags(
    values: np.ndarray,
    itemsize: int,
    offsets: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    out_offsets: np.ndarray,
    out_starts: np.ndarray,
) -> np.ndarray: ...
def interleave_bags(
    values: np.ndarray, itemsize: int, offsets: np.ndarray, out: np.ndarray, cursor: np.ndarray
) -> None: ...
def shuffle_through(buf: np.ndarray, incoming: np.ndarray, draws: np.ndarray, out: np.ndarray) -> None: ...
def take_fixed(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None: ...
def pool_bags(
    out: np.ndarray,
    offsets: np.ndarray,
    src: np.ndarray,
    idx: np.ndarray,
    scale: np.ndarray,
    out_col: int = 0,
    src_col: int = 0,
    width: int = -1,
    scatter: bool = False,
) -> None: ...
def gather_rows(
    table: np.ndarray,
    pos: np.ndarray,
    out: np.ndarray,
    default: float,
    last_seen: np.ndarray | None = None,
    freq: np.ndarray | None = None,
    clock: int = 0,
) -> None: ...
def put_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray, add: bool = False) -> None: ...
def ascending_rows(rows: np.ndarray, n: int, out: np.ndarray | None = None) -> tuple[int, bool]: ...
def stamp_rows(epochs: np.ndarray, pos: np.ndarray, epoch: int) -> int: ...
def flag_rows(bits: np.ndarray, pos: np.ndarray, rows: int) -> int: ...
def stamp_flagged(bits: np.ndarray, epochs: np.ndarray, epoch: int) -> int: ...
def mark_bits(bits: np.ndarray, slots: np.ndarray, on: np.ndarray) -> None: ...
def decode_places(codes: np.ndarray, bits: int, numbers: np.ndarray, firsts: np.ndarray) -> np.ndarray: ...
def pick_victims(
    key: np.ndarray,
    live: np.ndarray,
    protect: np.ndarray,
    mark: np.ndarray,
    used: int,
    n: int,
    low: int = 0,
    high: int = -1,
    tiebreak: np.ndarray | None = None,
) -> np.ndarray: ...
def rows_after(
    epochs: np.ndarray, since: int, live: np.ndarray | None = None, until: int | None = None
) -> np.ndarray: ...
def keep_changed(
    rows: np.ndarray,
    epochs: np.ndarray,
    since: int,
    mark: int,
    taken: int,
    array: np.ndarray,
    kept_rows: np.ndarray,
    kept_values: np.ndarray,
    start: int,
) -> int: ...
def unique_first(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
def id_span(ids: np.ndarray, unsigned: bool = False) -> tuple[int, int, bool]: ...
def unique_in_span(ids: np.ndarray, low: int, span: int) -> tuple[np.ndarray, np.ndarray]: ...
def unique_sorted(
    ids: np.ndarray, unsigned: bool = False, span: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]: ...
def argsort_stable(values: np.ndarray, unsigned: bool = False) -> np.ndarray: ...
def shard_ids(ids: np.ndarray, num_shards: int, salt: int) -> np.ndarray: ...
def create_rows(
    rows: np.ndarray,
    new_ids: np.ndarray,
    values: np.ndarray,
    slots: tuple[np.ndarray, ...],
    inits: tuple[float, ...],
    ids: np.ndarray,
    live: np.ndarray,
    last_seen: np.ndarray,
    freq: np.ndarray,
    epochs: np.ndarray,
    lookups: int,
    epoch: int,
    seed: int,
    golden: int,
    salt: int,
    low: float,
    high: float,
) -> None: ...
def initial_rows(
    ids: np.ndarray, seed: int, golden: int, salt: int, low: float, high: float, out: np.ndarray
) -> None: ...
def as_created(
    rows: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    slots: tuple[np.ndarray, ...],
    inits: tuple[float, ...],
    freq: np.ndarray,
    seed: int,
    golden: int,
    salt: int,
    low: float,
    high: float,
    out: np.ndarray,
) -> None: ...
def count_sightings(
    slots: np.ndarray,
    size: int,
    counts: np.ndarray,
    owners: np.ndarray,
    ids: np.ndarray,
    where: np.ndarray,
    admitted: np.ndarray,
    threshold: int,
    next_slot: int,
    room: int,
) -> tuple[int, int, int, int]: ...
def aligned_allocations() -> object: ...
def fingerprint64(data: np.ndarray, offsets: np.ndarray) -> np.ndarray: ...
