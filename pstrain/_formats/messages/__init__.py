"""_formats/messages: what is said. ``operations.py`` declares every operation once (its
request class, op name and reply class), ``records.py`` the field types and the request
base, ``checkpoint_operations.py`` and ``placement_map.py`` the operations of saves and
moves, ``closures.py`` what the coordinator and a worker say about closures, ``pickling.py``
how a closure is pickled for workers."""
