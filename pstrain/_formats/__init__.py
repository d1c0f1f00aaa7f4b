"""_formats: what both ends of a connection agree on, client and server alike: ``codec/``
(the wire encoding, frames, the handshake, pickled closures), ``messages/`` (every operation
declared once, and its records), ``files/`` (checkpoint, delta and tensor files) and
``numerics/`` (optimizer rules, initializers, schedules, id hashes, dtype casts);
``observability.py`` renders every task's metrics for Prometheus. See "Layout" in
docs/architecture.md."""
