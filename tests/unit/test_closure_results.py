"""A worker's closures' results as they travel back: one that cannot travel becomes that
closure's error, and the others in the message go on."""

from __future__ import annotations

import numpy as np

from pstrain._formats.messages.closures import ERROR, OK
from pstrain._formats.messages.records import ClosureResult
from pstrain._transport import wire
from pstrain.server.worker.closures import encode_results


def _decoded(encoded):
    return wire.decode_body(b"".join(bytes(c) for c in encoded.chunks), allow_pickle=True)["results"]


def test_a_result_over_the_limit_of_one_message_is_its_closures_error_alone():
    results = [
        ClosureResult(1, OK, np.arange(3)),
        ClosureResult(2, OK, np.zeros(10_000)),
        ClosureResult(3, OK, "x"),
    ]
    out = _decoded(encode_results(results, limit=50_000))
    assert [(r[0], r[1]) for r in out] == [(1, OK.value), (2, ERROR.value), (3, OK.value)]
    assert out[0][2].tolist() == [0, 1, 2] and out[2][2] == "x"
    assert out[1][2]["type"] == "TypeError"
    message = out[1][2]["message"]
    assert "result of type ndarray cannot be sent back to the coordinator" in message
    assert "it is 80032 bytes, more than the 50000 one message to the coordinator may carry" in message
    assert [r[1] for r in _decoded(encode_results(results))] == [OK.value] * 3  # under the default
