"""Coverage-guided fuzzing of the wire decoder and the stream handshake with atheris
(``make fuzz``).

Any input must decode or raise ProtocolError / InvalidArgumentError: a crash,
a hang or any other exception is a finding. The same bytes, cut in pieces, are
fed to the server's end of the handshake: it must never accept them (they hold
no proof of the token) nor hold more than ``MAX_PREAUTH`` bytes. Seeds are real
message bodies and hellos.

    python fuzz/fuzz_wire.py -max_total_time=300 fuzz/corpus
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    from pstrain._transport import wire
    from pstrain._transport.handshake import MAX_PREAUTH, ClientHandshake, ServerHandshake
    from pstrain.errors import InvalidArgumentError, ProtocolError


def one_input(data: bytes) -> None:
    try:
        wire.decode_body(data)
    except (ProtocolError, InvalidArgumentError):
        pass
    server = ServerHandshake(b"the token", "/job:ps/replica:0/task:0", "inc")
    cut = 1 + (data[0] % 64 if data else 0)
    for k in range(0, len(data), cut):
        if server.rejected is not None:
            break
        server.receive(data[k : k + cut])
        if server.accepted:
            raise AssertionError("the handshake accepted bytes that hold no proof of the token")
        if len(server.buf) > MAX_PREAUTH:
            raise AssertionError(f"the handshake holds {len(server.buf)} bytes before a proof")


def seeds() -> list[bytes]:
    return [
        b"".join(bytes(c) for c in wire.encode_body(obj))
        for obj in (
            {"names": ["w"]},
            {"name": "w", "value": np.arange(4, dtype=np.float32)},
            {"updates": [{"op": "assign", "name": "w", "value": np.zeros((2, 2))}]},
            ((1, (2,)), [3]),
            {"t": np.int64(3), "big": 2**70},
        )
    ] + [
        ClientHandshake(None, "/job:ps/replica:0/task:0").hello() + bytes(32),
        ClientHandshake(b"x", "").hello(),
    ]


if __name__ == "__main__":
    import os

    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus:
        os.makedirs(corpus, exist_ok=True)
        for i, seed in enumerate(seeds()):
            with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
                f.write(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
