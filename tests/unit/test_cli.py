"""The diloco command line."""

from __future__ import annotations

import pytest

from diloco import ServerConfig
from diloco.cli.main import main
from diloco.worker.transport.address import DEFAULT_PORT, server_url
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.cli import captured_config


def test_server_rejects_bad_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--port", "0", "--num-workers", "2", "--min-workers", "3"]) == 2
    assert "min_workers" in capsys.readouterr().err
    assert main(["server", "--port", "0", "--outer-lr", "nan"]) == 2










def test_server_makes_up_a_token_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = captured_config(monkeypatch)
    assert main(["server", "--host", "0.0.0.0", "--port", "0"]) == 0
    token = seen[0].token
    assert token is not None and len(token) >= 24
    assert f"DILOCO_TOKEN={token}" in capsys.readouterr().err
    # On loopback no token is made up; a given one is used as is; TLS and admin flags pass on.
    assert main(["server", "--host", "127.0.0.1", "--port", "0"]) == 0
    assert seen[1].token is None
    assert main(["server", "--host", "10.0.0.5", "--token", "given-token-1",
                 "--admin-token", "admin-token-1", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                 "--auth-failure-limit", "9"]) == 0  # fmt: skip
    assert (seen[2].token, seen[2].admin_token) == ("given-token-1", "admin-token-1")
    assert (seen[2].tls_cert, seen[2].tls_key, seen[2].auth_failure_limit) == ("c.pem", "k.pem", 9)
    assert "DILOCO_TOKEN=" not in capsys.readouterr().err


def test_server_fresh_start_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = captured_config(monkeypatch)
    assert main(["server", "--port", "0", "--save-dir", "ckpt"]) == 0
    assert main(["server", "--port", "0", "--save-dir", "ckpt", "--fresh-start"]) == 0
    assert (seen[0].fresh_start, seen[1].fresh_start) == (False, True)


def test_server_timeouts_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = captured_config(monkeypatch)
    assert main(["server", "--port", "0"]) == 0
    assert seen[0].body_timeout == 60.0
    assert main(["server", "--port", "0", "--body-timeout", "5", "--poll-timeout", "7"]) == 0
    assert (seen[1].body_timeout, seen[1].poll_timeout) == (5.0, 7.0)


def test_server_upload_slots_reach_the_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = captured_config(monkeypatch)
    assert main(["server", "--port", "0"]) == 0
    assert main(["server", "--port", "0", "--upload-slots", "3"]) == 0
    assert (seen[0].upload_slots, seen[1].upload_slots) == (1, 3)
    assert main(["server", "--port", "0", "--upload-slots", "0"]) != 0
    assert "upload_slots" in capsys.readouterr().err
    assert len(seen) == 2  # the refused one never reached a server


def test_server_refuses_a_negative_body_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--port", "0", "--body-timeout", "-1"]) != 0
    assert "body_timeout" in capsys.readouterr().err


def test_server_connection_and_rate_bounds_reach_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diloco.server.config import ServerConfig

    seen = captured_config(monkeypatch)
    assert main(["server", "--port", "0"]) == 0
    names = (
        "min_upload_rate",
        "upload_rate_window",
        "header_timeout",
        "max_connections",
        "max_connections_per_ip",
    )
    defaults = ServerConfig()
    assert [getattr(seen[0], n) for n in names] == [getattr(defaults, n) for n in names]
    flags = ["--min-upload-rate", "0", "--upload-rate-window", "5", "--header-timeout", "3"]
    flags += ["--max-connections", "100", "--max-connections-per-ip", "8"]
    assert main(["server", "--port", "0", *flags]) == 0
    assert [getattr(seen[1], n) for n in names] == [0.0, 5.0, 3.0, 100, 8]




@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("localhost", "http://localhost:8512"),
        ("localhost/", "http://localhost:8512"),
        ("10.0.0.5", "http://10.0.0.5:8512"),
        ("[::1]", "http://[::1]:8512"),
        ("localhost:9000", "http://localhost:9000"),
        ("http://localhost", "http://localhost"),  # a URL is taken as written
        ("https://diloco.example/", "https://diloco.example"),
    ],
)
def test_a_host_without_a_port_means_the_default_port(given: str, url: str) -> None:
    assert DEFAULT_PORT == ServerConfig.port
    assert server_url(given) == url
    assert DiLoCoClient(given).base_url == url


def test_a_bad_port_in_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="not a number"):
        server_url("localhost:http")
