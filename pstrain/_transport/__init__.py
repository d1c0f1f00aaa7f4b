"""_transport: the connection, both of its ends in one place.

``wire.py`` encodes a message (a msgpack header, then raw tensor buffers), ``frames.py``
frames messages on a stream, ``handshake.py`` is the mutual handshake (both ends,
sans-I/O). The client end: ``client.py`` (one connection's protocol), ``channels.py``
(:class:`Channel` and :class:`ChannelPool`), ``session.py`` (the job's state the channels
share), ``traffic.py`` (per-step counters), ``bridge.py`` and ``interrupt.py`` (calling
channels from threads). The listening end: ``listener.py`` (sniffing, the handshake, then
frames into the server's one reply path) and ``preauth.py`` (deadlines and a cap on
connections that have not authenticated). See "Layout" in docs/architecture.md."""
