"""_formats/files: what is written to disk. ``tensor_files.py`` (safetensors, written
atomically), ``checkpoint_files.py`` (a checkpoint: its index and each ps's files),
``delta_files.py`` (what changed since a full checkpoint), ``checksums.py``,
``direct_writes.py`` (large files past the page cache) and ``table_feed.py`` (the serving
feed's reading of a table's saves)."""
