"""Coverage-guided fuzzing of the wire decoder with atheris (``make fuzz``).

Any input must decode or raise ProtocolError / InvalidArgumentError: a crash,
a hang or any other exception is a finding. Seeds are real message bodies.

    python fuzz/fuzz_wire.py -max_total_time=300 fuzz/corpus
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    from pstrain import wire
    from pstrain.errors import InvalidArgumentError, ProtocolError


def one_input(data: bytes) -> None:
    try:
        wire.decode_body(data)
    except (ProtocolError, InvalidArgumentError):
        pass


def seeds() -> list[bytes]:
    return [b"".join(bytes(c) for c in wire.encode_body(obj)) for obj in (
        {"names": ["w"]}, {"name": "w", "value": np.arange(4, dtype=np.float32)},
        {"updates": [{"op": "assign", "name": "w", "value": np.zeros((2, 2))}]}, ((1, (2,)), [3]),
        {"t": np.int64(3), "big": 2**70})]


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
