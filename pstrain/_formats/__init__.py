"""_formats: what both ends agree on, client and server alike: ``messages/`` (every
operation declared once, its records, pickled closures), ``files/`` (checkpoint, delta and
tensor files) and ``numerics/`` (optimizer rules, initializers, schedules, id hashes, dtype
casts); ``observability.py`` renders every task's metrics for Prometheus. How the bytes
travel is ``_transport/``. See "Layout" in docs/architecture.md."""
