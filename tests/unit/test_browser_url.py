"""The dashboard URL the server logs at start (``server.browser_url``): one a browser can open."""

from __future__ import annotations

import pytest

from diloco.server.config import ServerConfig
from diloco.server.server import browser_url


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, "http://127.0.0.1:8512"),
        ({"host": "10.1.2.3"}, "http://10.1.2.3:8512"),
        ({"host": "::1"}, "http://[::1]:8512"),
        # Every interface: the machine's name, which a server with a token answers to...
        ({"host": "0.0.0.0", "token": "long-enough"}, "http://trainer-7:8512"),
        ({"host": "::", "admin_token": "long-enough"}, "http://trainer-7:8512"),
        # ...and one without answers only local names and IP addresses (DNS rebinding).
        ({"host": "0.0.0.0"}, "http://127.0.0.1:8512"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "https://127.0.0.1:8512"),
    ],
)
def test_browser_url(settings: dict[str, str], expected: str) -> None:
    assert browser_url(ServerConfig(**settings), 8512, hostname="trainer-7") == expected
