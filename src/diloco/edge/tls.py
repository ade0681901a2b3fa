"""TLS for the project's HTTP servers (the server, a swarm peer's stage service): one context
rule, so both sides of the project serve the same protocol floor."""

from __future__ import annotations

import ssl


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A server-side context for the PEM chain ``cert`` and its private ``key`` (TLS 1.2 or
    newer); None when ``cert`` is None (serve plain HTTP). Both or neither: a key without a
    certificate, or the reverse, is a ``ValueError`` (a half-configured TLS must not fall back
    to plain HTTP silently)."""
    if (cert is None) != (key is None):
        raise ValueError("a TLS certificate and its key go together: give both or neither")
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
