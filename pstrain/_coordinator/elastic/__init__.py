"""_coordinator/elastic: the job's parameter servers as they change while training runs.

``health.py`` is what the coordinator knows of each ps (sans-I/O, driven by
``_coordinator/heartbeat.py``); ``plans.py`` plans what moves when a ps joins or leaves
(sans-I/O); ``moves.py`` carries the moves out (the move protocol, one move at a time, under
the placement lock); ``replace.py`` replaces a lost ps from the latest checkpoint while the
others train.
"""
