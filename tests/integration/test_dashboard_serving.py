"""Serving the dashboard (issue 27): ``--no-dashboard``, its URL in the start-up log, and the
page's first look at /status without a token, which is no failed authentication while a
wrong token still is."""

from __future__ import annotations

import logging

import pytest
import requests

from diloco.cli import flags
from diloco.cli.main import build_parser
from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from tests.helpers.http import AUTH, TIMEOUT, TOKEN, assert_error, url
from tests.helpers.servers import ServerFactory

DASHBOARD_PATHS = ("/", "/dashboard", "/dashboard/app.js", "/dashboard/style.css")
PROBE = {"X-Diloco-Client": "dashboard"}  # what dashboard/app.js sends with every request


def auth_failures(server: DiLoCoServer) -> int:
    text = requests.get(url(server, "/metrics"), headers=AUTH, timeout=TIMEOUT).text
    (line,) = [x for x in text.splitlines() if x.startswith("diloco_auth_failures_total ")]
    return int(float(line.split()[1]))


@pytest.mark.parametrize("token", [None, TOKEN])
def test_no_dashboard_answers_404_and_status_still_serves(
    make_server: ServerFactory, token: str | None
) -> None:
    server = make_server(dashboard_enabled=False, token=token)
    for path in DASHBOARD_PATHS:  # with or without a token: 404, as any unknown path
        assert_error(requests.get(url(server, path), timeout=TIMEOUT), 404, "not_found")
    resp = requests.get(url(server, "/status"), headers=AUTH if token else {}, timeout=TIMEOUT)
    assert resp.status_code == 200 and resp.json()["mode"] == "sync"
    on = make_server(token=token)
    for path in DASHBOARD_PATHS:
        assert requests.get(url(on, path), timeout=TIMEOUT).status_code == 200, path


def test_the_no_dashboard_flag_is_the_setting() -> None:
    args = build_parser().parse_args(["server", "--no-dashboard"])
    assert flags.values(ServerConfig, args)["dashboard_enabled"] is False
    args = build_parser().parse_args(["server"])
    assert flags.values(ServerConfig, args)["dashboard_enabled"] is True


def test_the_start_up_log_names_the_dashboard_url(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="diloco.server.server"):
        server = make_server()
        off = make_server(dashboard_enabled=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Dashboard:")]
    assert lines == [f"Dashboard: http://127.0.0.1:{server.port}/dashboard"]  # not `off`'s
    assert off.port != server.port
    page = requests.get(lines[0].split(" ", 1)[1], timeout=TIMEOUT)  # the URL opens the page
    assert page.status_code == 200 and "<title>diloco</title>" in page.text


def test_the_pages_first_look_without_a_token_is_no_failed_authentication(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(token=TOKEN, auth_failure_limit=3)
    with caplog.at_level(logging.WARNING, logger="diloco.server.web.security"):
        # More looks than the limit allows failures: each is a 401 that makes the page ask for
        # the token, none is logged, counted or throttled.
        for _ in range(5):
            resp = requests.get(url(server, "/status"), headers=PROBE, timeout=TIMEOUT)
            assert_error(resp, 401, "unauthorized")
        assert caplog.records == []
        assert auth_failures(server) == 0
        # A wrong token typed into the page is a failed authentication: logged and counted.
        wrong = {**PROBE, "Authorization": "Bearer not-the-token"}
        assert_error(
            requests.get(url(server, "/status"), headers=wrong, timeout=TIMEOUT),
            401,
            "unauthorized",
        )
        assert [r.getMessage() for r in caplog.records] == [
            "refused GET /status from 127.0.0.1: bad token"
        ]
    assert auth_failures(server) == 1
    # Without a token from anything but the page (a worker started without its token), or on
    # another path: counted as before.
    for path, client in (("/status", "worker"), ("/metrics", "dashboard")):
        headers = {"X-Diloco-Client": client}
        assert_error(
            requests.get(url(server, path), headers=headers, timeout=TIMEOUT), 401, "unauthorized"
        )
    assert auth_failures(server) == 3
    # The limit reached, the throttle holds for the page's look too.
    resp = requests.get(url(server, "/status"), headers=PROBE, timeout=TIMEOUT)
    assert_error(resp, 429, "too_many_auth_failures")
