"""_formats/codec: how bytes travel. ``wire.py`` encodes a message (a msgpack header, then
raw tensor buffers), ``protocol.py`` frames messages on a stream connection, ``handshake.py``
is the stream handshake (both ends, sans-I/O), ``pickling.py`` pickles closures for workers.
The client side of a connection is ``_transport/rpc.py``, the listening side
``_serving/stream.py``."""
