"""TLS for the daemon's endpoint: the token, and what a capture returns, must not cross a
network in clear."""
from __future__ import annotations

import ssl

from ..errors import ProfinferError


def server_context(cert: str, key: str | None) -> ssl.SSLContext:
    """A server context from a PEM certificate (chain) and its key (None: in the same file)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise ProfinferError(f"--tls-cert/--tls-key: {e.filename or cert}: no such file") from None
    except (ssl.SSLError, OSError) as e:
        raise ProfinferError(f"--tls-cert {cert} --tls-key {key}: not a certificate and its key "
                             f"({getattr(e, 'reason', None) or e.strerror or e})") from None
    return ctx


def wrap_accepted(server, ctx: ssl.SSLContext) -> None:
    """Each accepted connection wrapped, its handshake left to the thread that serves it
    (handshake()): a client that never completes one holds no more than a request does."""
    accept = server.get_request

    def get_request():
        sock, addr = accept()
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    server.get_request = get_request


def handshake(conn) -> bool:
    """The TLS handshake on an accepted connection (under its timeout); False when the client
    does not complete it (plain HTTP, a certificate it refuses, gone)."""
    if not isinstance(conn, ssl.SSLSocket):
        return True
    try:
        conn.do_handshake()
        return True
    except (ssl.SSLError, OSError):
        return False
