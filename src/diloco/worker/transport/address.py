"""How a server address becomes the base URL every call of the client starts from."""

from __future__ import annotations

import urllib.parse

DEFAULT_PORT = 8512
"""The port of a server address that names none (``ServerConfig.port``'s default)."""


def server_url(addr: str) -> str:
    """The base URL of a server address. ``host`` or ``host:port`` is plain HTTP, and a host
    without a port means the default port (``localhost`` -> ``http://localhost:8512``); a URL
    with a scheme is taken as written (``https://host`` is port 443, behind a proxy, say)."""
    if "://" in addr:
        return addr.rstrip("/")
    split = urllib.parse.urlsplit(f"http://{addr.rstrip('/')}")
    try:
        port = split.port
    except ValueError:
        raise ValueError(f"server address {addr!r}: the port is not a number in 0-65535") from None
    netloc = split.netloc if port is not None else f"{split.netloc.rstrip(':')}:{DEFAULT_PORT}"
    return f"http://{netloc}{split.path}"
