"""The stream handshake as two sans-I/O machines: bytes in, bytes out, a verdict.

The messages and what each proof covers are ``auth.py``'s. Both ends feed what
they receive into :class:`ServerHandshake` / :class:`ClientHandshake` and
write what these return; nothing here reads a socket, so the tests (and the
fuzzer) drive every byte of it directly. The server reads at most
:data:`MAX_PREAUTH` bytes before the client's proof holds, and nothing after
the handshake is looked at here: the rest is handed on, undecoded, to the
frame reader.

>>> server = ServerHandshake(b"k", "/job:ps/replica:0/task:0", "inc")
>>> client = ClientHandshake(b"k", "/job:ps/replica:0/task:0")
>>> to_client = server.receive(client.hello())
>>> to_server = client.receive(to_client)
>>> client.receive(server.receive(to_server)) == b"" and server.accepted and client.done
True
>>> client.identity
'/job:ps/replica:0/task:0#inc'
"""

from __future__ import annotations

from .._base.auth import (
    CLIENT,
    NONCE_BYTES,
    PROOF_BYTES,
    SERVER,
    identity,
    new_nonce,
    proof,
    proof_ok,
    target_matches,
    transcript,
)

__all__ = [
    "ACCEPTED",
    "MAGIC",
    "MAX_PREAUTH",
    "REJECTED",
    "WRONG_TASK",
    "ClientHandshake",
    "HandshakeFailed",
    "ServerHandshake",
]

MAGIC = b"PSTRAIN3"  # 3: proofs bound to both ends (2: to the nonces only; 1: the token itself)
ACCEPTED, REJECTED, WRONG_TASK = b"\x00", b"\x01", b"\x02"
_HELLO_FIXED = len(MAGIC) + NONCE_BYTES + 1  # then the target, up to 255 bytes
#: Bytes a client may send before its proof holds: the largest hello and the proof.
MAX_PREAUTH = _HELLO_FIXED + 255 + PROOF_BYTES


class HandshakeFailed(Exception):
    """Why a handshake failed: ``kind`` is ``foreign`` (not a pstrain server of this
    version), ``wrong_task`` (``actual`` names the task there), ``rejected`` (the server
    refused our proof), ``unproven`` (the server could not prove the token) or
    ``impostor`` (it proved the token but is not the task dialled)."""

    def __init__(self, kind: str, detail: str = "", actual: str = "", first: bytes = b"") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail, self.actual, self.first = kind, detail, actual, first


class ServerHandshake:
    """The server's end. ``receive(data)`` returns what to send; then ``accepted`` (and
    ``rest``: bytes after the handshake, for the frame reader) or ``rejected`` (a reason
    for the log; the caller sends what was returned and closes)."""

    def __init__(self, token: bytes | None, task: str, incarnation: str, *, any_index: bool = False) -> None:
        self.token, self.task, self.incarnation, self.any_index = token, task, incarnation, any_index
        self.buf = bytearray()
        self.client_nonce: bytes | None = None
        self.target = b""
        self.server_nonce = b""
        self.accepted = False
        self.rejected: str | None = None
        self.rest = b""

    def receive(self, data: bytes) -> bytes:
        if self.accepted or self.rejected is not None:
            raise RuntimeError("the handshake is over")
        buf = self.buf
        buf.extend(data)
        if self.client_nonce is None:
            if not MAGIC.startswith(bytes(buf[: len(MAGIC)])):
                return self._reject("not a pstrain hello")
            if len(buf) < _HELLO_FIXED or len(buf) < _HELLO_FIXED + buf[_HELLO_FIXED - 1]:
                return b""
            end = _HELLO_FIXED + buf[_HELLO_FIXED - 1]
            self.client_nonce = bytes(buf[len(MAGIC) : len(MAGIC) + NONCE_BYTES])
            self.target = bytes(buf[_HELLO_FIXED:end])
            del buf[:end]
            if not target_matches(self.target, self.task, any_index=self.any_index):
                actual = self.task.encode()
                self.rejected = f"dialled as {self.target.decode(errors='replace')!r}"
                return WRONG_TASK + bytes([len(actual)]) + actual
            self.server_nonce = new_nonce()
            out = MAGIC + self.server_nonce
        else:
            out = b""
        if len(buf) < PROOF_BYTES:
            return out
        given = bytes(buf[:PROOF_BYTES])
        seen = transcript(self.client_nonce, self.target, self.server_nonce)
        if not proof_ok(self.token, CLIENT, seen, given):
            return out + self._reject("wrong or missing token")
        me = identity(self.task, self.incarnation)
        self.accepted = True
        self.rest = bytes(buf[PROOF_BYTES:])
        buf.clear()
        answer = proof(self.token, SERVER, transcript(self.client_nonce, self.target, self.server_nonce, me))
        return out + ACCEPTED + bytes([len(me)]) + me + answer

    def _reject(self, why: str) -> bytes:
        self.rejected = why
        return REJECTED


class ClientHandshake:
    """The client's end: ``hello()`` first, then ``receive(data)`` returns what to send,
    until ``done`` (``identity``: the task that answered; ``rest``: bytes after the
    handshake). A failure raises :class:`HandshakeFailed`."""

    def __init__(self, token: bytes | None, target: str) -> None:
        self.token = token
        self.target = target.encode()
        if len(self.target) > 255:
            raise ValueError(f"a task name of at most 255 bytes, got {target!r}")
        self.nonce = new_nonce()
        self.server_nonce: bytes | None = None
        self.buf = bytearray()
        self.done = False
        self.identity = ""
        self.rest = b""

    def hello(self) -> bytes:
        return MAGIC + self.nonce + bytes([len(self.target)]) + self.target

    def receive(self, data: bytes) -> bytes:
        buf = self.buf
        buf.extend(data)
        if self.server_nonce is None:
            if buf[:1] == WRONG_TASK:
                if len(buf) < 2 or len(buf) < 2 + buf[1]:
                    return b""
                raise HandshakeFailed(
                    "wrong_task", actual=bytes(buf[2 : 2 + buf[1]]).decode("utf-8", "replace")
                )
            if not MAGIC.startswith(bytes(buf[: len(MAGIC)])):
                raise HandshakeFailed("foreign", first=bytes(buf[:32]))
            if len(buf) < len(MAGIC) + NONCE_BYTES:
                return b""
            self.server_nonce = bytes(buf[len(MAGIC) : len(MAGIC) + NONCE_BYTES])
            del buf[: len(MAGIC) + NONCE_BYTES]
            out = proof(self.token, CLIENT, transcript(self.nonce, self.target, self.server_nonce))
        else:
            out = b""
        if not buf:
            return out
        if buf[:1] != ACCEPTED:
            raise HandshakeFailed("rejected")
        if len(buf) < 2 or len(buf) < 2 + buf[1] + PROOF_BYTES:
            return out
        end = 2 + buf[1]
        answering = bytes(buf[2:end])
        given = bytes(buf[end : end + PROOF_BYTES])
        seen = transcript(self.nonce, self.target, self.server_nonce, answering)
        if not proof_ok(self.token, SERVER, seen, given):
            raise HandshakeFailed("unproven")
        task = answering.decode("utf-8", "replace").partition("#")[0]
        if not target_matches(self.target, task, any_index=False) and not _joined(self.target, task):
            raise HandshakeFailed("impostor", actual=task)
        self.identity = answering.decode("utf-8", "replace")
        self.rest = bytes(buf[end + PROOF_BYTES :])
        buf.clear()
        self.done = True
        return out


def _joined(target: bytes, task: str) -> bool:
    """A worker that joined (``--join``) may still carry its own index when dialled as
    the slot it was given: the same job is the task dialled."""
    return target_matches(target, task, any_index=True) and target.startswith(b"/job:worker/")
