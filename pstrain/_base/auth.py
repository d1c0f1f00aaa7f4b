"""Authentication shared by every listener and every channel.

* HTTP (for curl and Prometheus): ``Authorization: Bearer <token>``, compared
  in constant time as bytes; a header that is not plain ASCII is simply wrong.
* pstrain's own stream: a challenge-response handshake in which *both* sides
  prove they know the token, the token never crosses the wire, and each proof
  covers the whole transcript, including which task the client meant to reach
  and which task answered::

      client -> server   MAGIC, client nonce (32), target (the task it dials)
      server -> client   MAGIC, server nonce (32)        (or WRONG_TASK, its task: a
                                                          target that is not this task)
      client -> server   proof(client -> server)          (the client proves first)
      server -> client   ACCEPTED, identity, proof(server -> client)   (only for a valid
                                                          proof; else REJECTED)

  ``transcript = version, client nonce, target, server nonce[, identity]``, each
  length-prefixed; ``proof(direction) = HMAC-SHA256(token, direction + transcript)``;
  ``identity`` is the answering task, with its incarnation
  (``/job:ps/replica:0/task:1#3f9c...``). The client accepts only an identity that is
  the task it dialled. So a process that holds a dead task's port and relays the
  handshake to another task proves nothing: the other task refuses a target that is
  not its own, a rewritten target breaks the client's proof, and the client refuses an
  answer from a task it did not dial. The server gives no proof before the client's
  holds: a token guesser who dials a server learns nothing it can check offline.
  Without a token (loopback only) the key is empty: both sides still run the
  handshake, and a client with a token refuses a server without one.

What the token protects, and what it does not: every task holding it may run code
on the workers (closures are pickled functions) and on the ps (``vars/call``, closed
by ``--no-pickle``); without it, no byte reaches a decoder or the unpickler. It does
not encrypt or sign the frames after the handshake: on a network where someone can
intercept and relay to the genuine task, use TLS (``--tls-cert``/``--tls-key``).

An empty token is no token.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

__all__ = [
    "NONCE_BYTES",
    "PROOF_BYTES",
    "VERSION",
    "bearer_ok",
    "identity",
    "new_nonce",
    "normalize_token",
    "proof",
    "proof_ok",
    "target_matches",
    "transcript",
]

NONCE_BYTES = 32
PROOF_BYTES = 32
#: The handshake's version, bound into every proof.
VERSION = b"pstrain-v3"
CLIENT, SERVER = b"client->server", b"server->client"
_TASK = re.compile(rb"/job:([a-z]+)/replica:0/task:(\d+)")


def normalize_token(token: str | None) -> str | None:
    """``token``, or None for no token (an empty or all-blank one included).

    >>> normalize_token(""), normalize_token(" s3cret ")
    (None, 's3cret')
    """
    if token is None:
        return None
    token = token.strip()
    return token or None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def transcript(client_nonce: bytes, target: bytes, server_nonce: bytes, answering: bytes = b"") -> bytes:
    """What the proofs cover: each part length-prefixed, so no two transcripts collide.

    >>> transcript(b"a", b"", b"b") != transcript(b"", b"a", b"b")
    True
    """
    return b"".join(
        len(p).to_bytes(2, "big") + p for p in (VERSION, client_nonce, target, server_nonce, answering)
    )


def proof(token: bytes | None, direction: bytes, transcript: bytes) -> bytes:
    """What the side speaking in ``direction`` (CLIENT or SERVER) sends to prove the token.

    The HMAC key is a hash of the token, not the token: HMAC pads a key with zero bytes,
    so a token of NUL bytes would otherwise prove the same as no token at all."""
    key = hashlib.sha256(VERSION + b" key\x00" + (token or b"")).digest()
    return hmac.new(key, direction + b"\x00" + transcript, hashlib.sha256).digest()


def proof_ok(token: bytes | None, direction: bytes, transcript: bytes, given: bytes) -> bool:
    """Is ``given`` the proof owed in ``direction``? (constant time)"""
    return hmac.compare_digest(proof(token, direction, transcript), given)


def identity(task: str, incarnation: str) -> bytes:
    """How a server names itself in the handshake: its task and incarnation."""
    return f"{task}#{incarnation}".encode()


def target_matches(target: bytes, task: str, *, any_index: bool = False) -> bool:
    """Does a client dialling ``target`` mean ``task``? An empty target means any task (a
    tool that dials an address, not a task); ``any_index``: a worker that joined takes
    whatever worker index the coordinator dials it as.

    >>> target_matches(b"/job:ps/replica:0/task:1", "/job:ps/replica:0/task:1")
    True
    >>> target_matches(b"/job:ps/replica:0/task:1", "/job:worker/replica:0/task:1")
    False
    """
    if not target:
        return True
    if target == task.encode():
        return True
    want, have = _TASK.fullmatch(target), _TASK.fullmatch(task.encode())
    return bool(any_index and want and have and want.group(1) == have.group(1))


def bearer_ok(header: str | None, token: bytes | None) -> bool:
    """Does an ``Authorization`` header carry ``Bearer <token>``? (No token: anyone.)

    >>> bearer_ok("Bearer s3cret", b"s3cret"), bearer_ok("Bearer nope", b"s3cret")
    (True, False)
    """
    if token is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        raw = given.strip().encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, token)
