"""Authentication shared by every listener and every channel.

* HTTP (for curl and Prometheus): ``Authorization: Bearer <token>``, compared
  in constant time as bytes; a header that is not plain ASCII is simply wrong.
* pstrain's own stream: a challenge-response handshake in which *both* sides
  prove they know the token, and the token never crosses the wire::

      client -> server   MAGIC, client nonce (32 bytes)
      server -> client   MAGIC, server nonce (32), proof("server")
      client -> server   proof("client")            (only if the server's proof holds)
      server -> client   ACCEPTED | REJECTED        (then frames)

  ``proof(role) = HMAC-SHA256(token, "pstrain-v2/" + role + client nonce +
  server nonce)``. A process that binds a dead task's port learns nothing from
  a client (it never sees a proof before giving its own), and fails it.
  Without a token (loopback only) the key is empty: both sides still run
  the handshake, and a client with a token refuses a server without one.

An empty token is no token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE_BYTES", "PROOF_BYTES", "bearer_ok", "new_nonce", "normalize_token", "proof",
           "proof_ok"]

NONCE_BYTES = 32
PROOF_BYTES = 32


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


def proof(token: bytes | None, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What ``role`` (b"client" or b"server") sends to prove it knows ``token``."""
    return hmac.new(token or b"", b"pstrain-v2/" + role + client_nonce + server_nonce,
                    hashlib.sha256).digest()


def proof_ok(token: bytes | None, role: bytes, client_nonce: bytes, server_nonce: bytes,
             given: bytes) -> bool:
    """Is ``given`` the proof ``role`` owes? (constant time)"""
    return hmac.compare_digest(proof(token, role, client_nonce, server_nonce), given)


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
