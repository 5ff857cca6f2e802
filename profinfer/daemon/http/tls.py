"""TLS for the daemon's endpoint: the token, and what a capture returns, must not cross a
network in clear."""
from __future__ import annotations

import ssl

from profinfer.core.base.errors import ProfinferError


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
