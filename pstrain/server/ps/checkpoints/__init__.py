"""server/ps/checkpoints: the ps's side of saving. ``saves.py`` writes full checkpoints and
stages restores (committed all or nothing), ``snapshots.py`` keeps a large array as it was
when a save began, ``deltas.py`` writes what changed since a mark, and ``feed.py`` serves a
table's saved changes to a serving mirror."""
