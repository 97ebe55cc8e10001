"""HMAC challenge handshake with the shared cluster secret.

Both sides prove they hold the secret without sending it: each picks a fresh nonce and answers
the other's with an HMAC over both nonces (and the hello it sends), so a recorded handshake cannot
be replayed and a peer without the secret learns nothing but two random nonces. The data that
follows is not encrypted; the secret keeps strangers from reading or writing registered memory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from .errors import AuthenticationError, PeerError
from .wire import decode_json, encode_json, recv_exact

MAGIC = b"MCPYTE01"
NONCE_BYTES = 32
MAC_BYTES = 32
_LEN = struct.Struct("<I")
_MAX_HELLO = 64 << 10


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    if not recv_exact(sock, memoryview(buf), deadline=deadline):
        raise ConnectionError("connection closed during the handshake")
    return bytes(buf)


def _recv_hello(sock: socket.socket, deadline: float | None = None) -> bytes:
    (n,) = _LEN.unpack(_recv(sock, _LEN.size, deadline))
    if n > _MAX_HELLO:
        raise AuthenticationError(f"hello of {n} bytes is too large")
    return _recv(sock, n, deadline)


def client_handshake(sock: socket.socket, secret: bytes, hello: dict) -> dict:
    """Authenticate to a Messenger; returns the server's hello. Raises AuthenticationError."""
    began = False  # whether the peer began the handshake: a close before that is not about the secret
    try:
        magic = _recv(sock, len(MAGIC))
        began = True
        if magic != MAGIC:
            raise AuthenticationError("peer does not speak this transfer protocol")
        server_nonce = _recv(sock, NONCE_BYTES)
        client_nonce = os.urandom(NONCE_BYTES)
        body = encode_json(hello)
        mac = _mac(secret, b"client", server_nonce, client_nonce, body)
        sock.sendall(client_nonce + mac + _LEN.pack(len(body)) + body)
        server_mac = _recv(sock, MAC_BYTES)
        server_body = _recv_hello(sock)
    except socket.timeout as exc:  # a frozen or overloaded peer, not a refusal
        raise PeerError(f"no handshake from the peer within {sock.gettimeout():g} s") from exc
    except ConnectionError as exc:
        if not began:
            # Closed before any proof was asked: too many connections in their handshake there
            # (it gave this one's slot to a newer one), or it is shutting down.
            raise PeerError(f"the peer closed the connection before its handshake began: {exc}") from exc
        # The Messenger closes without a word when our proof is wrong, and when it gives a crowded
        # handshake's slot to a newer connection.
        raise AuthenticationError(f"the peer closed the connection during the handshake (a wrong cluster secret, "
                                  f"or too many connections in their handshake there): {exc}") from exc
    if not hmac.compare_digest(server_mac, _mac(secret, b"server", client_nonce, server_nonce, server_body)):
        raise AuthenticationError("peer failed to prove it holds the cluster secret")
    return decode_json(server_body)


def server_handshake(sock: socket.socket, secret: bytes, hello: dict, timeout_s: float | None = None) -> dict:
    """Challenge a connecting peer; returns its hello. Raises AuthenticationError on a bad proof,
    and ``socket.timeout`` when the peer's answer is not all in within ``timeout_s``: a stranger
    trickling bytes cannot hold the thread that serves it (the socket keeps the timeout left)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    client_nonce = _recv(sock, NONCE_BYTES, deadline)
    client_mac = _recv(sock, MAC_BYTES, deadline)
    client_body = _recv_hello(sock, deadline)
    if not hmac.compare_digest(client_mac, _mac(secret, b"client", server_nonce, client_nonce, client_body)):
        raise AuthenticationError("peer's proof does not match the cluster secret")
    body = encode_json(hello)
    sock.sendall(_mac(secret, b"server", client_nonce, server_nonce, body) + _LEN.pack(len(body)) + body)
    return decode_json(client_body)
