"""server/ps/tables: the ps's dynamic embedding tables. ``handlers.py`` serves the ``dyn/*``
operations; a table's shard is ``dynamic_table.py`` (rows keyed by raw ids, with
``_kernels/id_index.py`` its hash index, ``admission.py`` its admission of new ids,
``removed_log.py`` its evictions kept for the next delta, ``table_config.py`` what it is,
fixed at creation); ``table_slices.py`` moves slices of its hash space between ps. On a
ps with a byte budget and a table directory a shard is ``tiered_table.py``: its hot rows
in RAM, the rest on disk in ``cold_rows.py`` (their index and bookkeeping; the files
themselves are ``cold_segments.py``'s, each record laid out by ``cold_records.py``)."""
