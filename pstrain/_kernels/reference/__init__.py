"""The kernels in numpy: the reference the compiled ones are tested against, bit for bit.

Same signatures and results as :mod:`pstrain._kernels.compiled` (only where an index puts an
id may differ: both probe linearly from the id's hash, but the vectorised insert settles
contended slots in another order). Each operation takes a whole batch and probes it with one
numpy pass per probe step over the ids still looking, then a short Python loop for the few
long probes left, so it is a fair numpy implementation, not a strawman.

One module a concept, as :mod:`~pstrain._kernels.compiled` has one included file a concept
(``id_index.pxi`` and ``id_index.py``, ...); this package gives them as one module, as the
kernels are chosen as a whole.
"""

from __future__ import annotations

from .aligned_memory import aligned_allocations
from .bags import (
    bag_positions,
    interleave_bags,
    pool_bags,
    shuffle_through,
    take_bags,
    take_fixed,
    take_keyed_bags,
)
from .distinct_ids import argsort_stable, id_span, shard_ids, unique_first, unique_in_span, unique_sorted
from .id_index import (
    absent,
    compact_delete,
    compact_get,
    compact_insert,
    count_sightings,
    index_delete,
    index_get,
    index_insert,
    index_locate,
    index_refind,
    mix64,
    same_ids,
)
from .io_uring import cached_records, io_uring_reads, pread_records
from .new_rows import as_created, create_rows, initial_rows
from .optimizer_rows import adagrad_rows, rowwise_adagrad_rows, sgd_rows
from .rows import (
    ascending_rows,
    decode_places,
    flag_rows,
    gather_rows,
    keep_changed,
    mark_bits,
    pick_victims,
    put_rows,
    rows_after,
    stamp_flagged,
    stamp_rows,
)
from .strings import fingerprint64, siphash24
from .tf_records import crc32c, parse_examples, tfrecord_split

__all__ = [
    "absent",
    "adagrad_rows",
    "ascending_rows",
    "aligned_allocations",
    "argsort_stable",
    "as_created",
    "bag_positions",
    "interleave_bags",
    "cached_records",
    "compact_delete",
    "compact_get",
    "compact_insert",
    "count_sightings",
    "crc32c",
    "decode_places",
    "fingerprint64",
    "create_rows",
    "flag_rows",
    "gather_rows",
    "id_span",
    "index_delete",
    "index_get",
    "index_insert",
    "index_locate",
    "index_refind",
    "initial_rows",
    "io_uring_reads",
    "keep_changed",
    "mark_bits",
    "mix64",
    "parse_examples",
    "pick_victims",
    "pool_bags",
    "pread_records",
    "put_rows",
    "rows_after",
    "rowwise_adagrad_rows",
    "same_ids",
    "sgd_rows",
    "shard_ids",
    "shuffle_through",
    "siphash24",
    "stamp_flagged",
    "stamp_rows",
    "take_bags",
    "take_fixed",
    "take_keyed_bags",
    "tfrecord_split",
    "unique_first",
    "unique_in_span",
    "unique_sorted",
]
