"""server/ps/moves: the ps's side of moving variables and table slices to another ps while
training runs. ``handlers.py`` serves the move operations, ``stages.py`` keeps who started
each stage (and ends one whose coordinator went silent), ``ps_map.py`` is the placement map
this ps knows."""
