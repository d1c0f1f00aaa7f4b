"""Authentication checks shared by every listener: the HTTP bearer token.

The token is compared in constant time, as bytes; a header that is not
plain ASCII is simply wrong (never an error of the server).
"""

from __future__ import annotations

import hmac

__all__ = ["bearer_ok"]


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
