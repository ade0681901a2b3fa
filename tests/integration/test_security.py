"""Security against a real server on loopback: every endpoint behind the token (no state change
without it), the admin token, the cross-site rule, the DNS-rebinding guard of open servers, the
auth slowdown, body and header limits, response headers and TLS."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import requests
import torch

from diloco.server.server import DiLoCoServer
from diloco.server.web import security
from diloco.server.web.app import OPEN_PATHS, build_app
from diloco.wire import encode
from diloco.wire.messages.rendezvous import OPS
from diloco.worker.transport import client as client_module
from tests.helpers.http import (
    AUTH,
    CLIENT,
    EXACT,
    TIMEOUT,
    TOKEN,
    accept,
    assert_error,
    body,
    register,
    url,
)
from tests.helpers.security import JSON, assert_same, snapshot
from tests.helpers.servers import ServerFactory, initial_params

ADMIN = "admin-token-456"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}






# Every route with a body that would change state if it were accepted.
REQUESTS: dict[tuple[str, str], tuple[str, bytes | None, dict[str, str]]] = {
    ("POST", "/register"): ("/register", b'{"worker_id": "intruder"}', JSON),
    ("POST", "/deregister"): ("/deregister", b'{"worker_id": "b"}', JSON),
    ("POST", "/heartbeat"): ("/heartbeat", b'{"worker_id": "a", "loss": 9.0}', JSON),
    ("POST", "/submit_pseudograd"): (
        "/submit_pseudograd",
        body("b", 0, "b-0", seed=2),
        {"Content-Type": "application/octet-stream", **CLIENT},
    ),
    ("POST", "/initial_params"): (
        "/initial_params?worker_id=a",
        encode(initial_params(), {"worker_id": "a"}),
        {"Content-Type": "application/octet-stream", **CLIENT},
    ),
    ("GET", "/global_params"): ("/global_params?worker_id=a", None, {}),
    ("GET", "/status"): ("/status", None, {}),
    ("GET", "/metrics"): ("/metrics", None, {}),
    ("POST", "/control/save_state"): ("/control/save_state", b"{}", JSON),
    ("POST", "/control/kick_worker"): ("/control/kick_worker", b'{"worker_id": "a"}', JSON),
    ("POST", "/control/update_optimizer"): (
        "/control/update_optimizer",
        b'{"lr": 0.01, "momentum": 0.5}',
        JSON,
    ),
    ("POST", "/control/update_num_workers"): (
        "/control/update_num_workers",
        b'{"num_workers": 7}',
        JSON,
    ),
    ("POST", "/control/shutdown"): ("/control/shutdown", b'{"save": true}', JSON),
    ("POST", "/quorum"): ("/quorum", b'{"worker_id": "a", "round": 0, "hash": ""}', JSON),
    ("POST", "/quorum/outcome"): (
        "/quorum/outcome",
        b'{"worker_id": "a", "quorum_id": "q-1", "ok": false, "error": "x"}',
        JSON,
    ),
    **{
        ("POST", f"/rendezvous/{op}"): (
            f"/rendezvous/{op}",
            b'{"worker_id": "a", "quorum_id": "q-1", "key": "k", "keys": ["k"], "value": "eA==",'
            b' "amount": 1, "expected": "", "desired": "eA=="}',
            JSON,
        )
        for op in OPS
    },
    ("POST", "/swarm/ready"): (
        "/swarm/ready",
        b'{"worker_id": "a", "stage": 0, "params": [["w", [2]]], "address": "http://h:1"}',
        JSON,
    ),
    ("GET", "/swarm/routes"): ("/swarm/routes?version=-1", None, {}),
    ("POST", "/swarm/suspect"): (
        "/swarm/suspect",
        b'{"worker_id": "a", "suspect": "b", "stage": 0}',
        JSON,
    ),
}


def send(server: DiLoCoServer, key: tuple[str, str], headers: dict[str, str]) -> requests.Response:
    path, data, base = REQUESTS[key]
    return requests.request(
        key[0], url(server, path), data=data, headers={**base, **headers}, timeout=TIMEOUT
    )


def test_every_route_is_listed_here(make_server: ServerFactory) -> None:
    """A new route must be added to REQUESTS (and so to the 401 tests) or be open on purpose."""
    server = make_server()
    app = build_app(server.front)
    routes = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    open_routes = {(m, p) for m, p in routes if p in OPEN_PATHS or p in security_open_paths()}
    catch_all = {("*", "/{tail}")}  # unknown paths: 401 without the token, JSON 404 with it
    assert routes - open_routes - catch_all == set(REQUESTS)
    assert {p for _, p in open_routes} == {"/healthz", "/", "/dashboard"} | {
        "/dashboard/app.js",
        "/dashboard/style.css",
    }


def security_open_paths() -> frozenset[str]:
    from diloco.server.web import dashboard

    return dashboard.PATHS


@pytest.fixture
def guarded(make_server: ServerFactory, tmp_path: Path) -> DiLoCoServer:
    server = make_server(
        num_workers=2, token=TOKEN, admin_token=ADMIN, save_dir=str(tmp_path / "ckpt"), **EXACT
    )
    register(server, "a", AUTH)
    register(server, "b", AUTH)
    accept(server, body("a", 0, "a-0", seed=1), AUTH)
    return server


BAD = {
    "none": {},
    "wrong": {"Authorization": "Bearer admin-token-457"},
    "prefix": {"Authorization": f"Bearer {ADMIN[:-1]}"},
    "basic": {"Authorization": f"Basic {ADMIN}"},
}


@pytest.mark.parametrize("auth", sorted(BAD))
@pytest.mark.parametrize("route", sorted(REQUESTS), ids="{0[0]} {0[1]}".format)
def test_401_on_every_endpoint_without_the_token(
    guarded: DiLoCoServer, route: tuple[str, str], auth: str
) -> None:
    before = snapshot(guarded)
    reply = assert_error(send(guarded, route, BAD[auth]), 401, "unauthorized")
    assert "token" in reply["detail"]
    assert_same(before, guarded)
    assert requests.get(url(guarded, "/healthz"), timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize(
    "route", [k for k in sorted(REQUESTS) if k[1].startswith("/control/")], ids=str
)
def test_control_needs_the_admin_token_not_the_worker_token(
    guarded: DiLoCoServer, route: tuple[str, str]
) -> None:
    before = snapshot(guarded)
    reply = assert_error(send(guarded, route, AUTH), 401, "unauthorized")
    assert "admin token" in reply["detail"]
    assert_same(before, guarded)


def test_admin_token_works_everywhere(guarded: DiLoCoServer) -> None:
    assert send(guarded, ("GET", "/status"), ADMIN_AUTH).json()["round"] == 0
    assert send(guarded, ("GET", "/metrics"), ADMIN_AUTH).status_code == 200
    resp = send(guarded, ("POST", "/control/update_optimizer"), ADMIN_AUTH)
    assert resp.status_code == 200, resp.text
    assert guarded.status()["outer_optimizer"]["lr"] == 0.01


# --- the cross-site rule -------------------------------------------------------------------------


CROSS_SITE = {
    "form": ({"Content-Type": "application/x-www-form-urlencoded"}, b"save=true"),
    "multipart": ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n"),
    "text": ({"Content-Type": "text/plain"}, b'{"save": true}'),
    "json_without_header": ({"Content-Type": "application/json"}, b'{"save": true}'),
    "header_without_json": ({"Content-Type": "text/plain", **CLIENT}, b'{"save": true}'),
    "foreign_origin": ({**JSON, "Origin": "http://evil.example"}, b'{"save": true}'),
    "null_origin": ({**JSON, "Origin": "null"}, b'{"save": true}'),
}


@pytest.mark.parametrize("case", sorted(CROSS_SITE))
@pytest.mark.parametrize("with_token", [False, True])
def test_cross_site_shutdown_is_refused(
    make_server: ServerFactory, case: str, with_token: bool
) -> None:
    """What a hostile page can make a browser send never stops the server, open or not."""
    server = make_server(**({"token": TOKEN} if with_token else {}))
    headers, data = CROSS_SITE[case]
    if with_token:
        headers = {**headers, **AUTH}
    resp = requests.post(
        url(server, "/control/shutdown"), data=data, headers=headers, timeout=TIMEOUT
    )
    reply = assert_error(resp, 403, "cross_site")
    assert "X-Diloco-Client" in reply["detail"] or "origin" in reply["detail"]
    assert not server.wait_stopped(0)
    assert requests.get(url(server, "/healthz"), timeout=TIMEOUT).status_code == 200


def test_same_origin_json_with_the_header_is_accepted(make_server: ServerFactory) -> None:
    server = make_server()
    headers = {**JSON, "Origin": f"http://{server.address}"}
    resp = requests.post(
        url(server, "/control/update_num_workers"),
        data=b'{"num_workers": 3}',
        headers=headers,
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert server.status()["num_workers"] == 3


def test_open_server_refuses_foreign_host_names(make_server: ServerFactory) -> None:
    """DNS rebinding: a page re-pointed at 127.0.0.1 still sends its own name as Host."""
    server = make_server()
    port = server.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.example:{port}"):
        resp = requests.get(url(server, "/status"), headers={"Host": host}, timeout=TIMEOUT)
        assert_error(resp, 403, "bad_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.1"):
        resp = requests.get(url(server, "/status"), headers={"Host": host}, timeout=TIMEOUT)
        assert resp.status_code == 200, (host, resp.text)


def test_a_server_with_a_token_serves_any_host_name(make_server: ServerFactory) -> None:
    server = make_server(token=TOKEN)
    resp = requests.get(
        url(server, "/status"), headers={"Host": "trainer.example", **AUTH}, timeout=TIMEOUT
    )
    assert resp.status_code == 200, resp.text


def test_the_client_sends_the_cross_site_header() -> None:
    assert client_module.CLIENT_HEADER == security.CLIENT_HEADER


# --- slowdown ------------------------------------------------------------------------------------


def test_repeated_failures_slow_the_guesser_not_the_token_holder(
    make_server: ServerFactory,
) -> None:
    """Finding 7: after 5 failures from an address, the right token from it still passes."""
    server = make_server(token=TOKEN)  # the default limit: 5 failures a minute
    bad = {"Authorization": "Bearer guess-guess"}
    for _ in range(5):
        assert_error(
            requests.get(url(server, "/status"), headers=bad, timeout=TIMEOUT), 401, "unauthorized"
        )
    resp = requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    for headers in (bad, {}):  # a wrong token, or none: refused, and the connection closed
        resp = requests.get(url(server, "/status"), headers=headers, timeout=TIMEOUT)
        assert_error(resp, 429, "too_many_auth_failures")
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        assert resp.headers["Connection"] == "close"
    assert register(server, "a", AUTH)["worker_id"] == "a"  # a state change too
    assert requests.get(url(server, "/healthz"), timeout=TIMEOUT).status_code == 200
    metrics = requests.get(url(server, "/metrics"), headers=AUTH, timeout=TIMEOUT).text
    assert "diloco_auth_failures_total 5" in metrics
    assert "diloco_auth_throttled_total 2" in metrics


def test_throttle_window_and_bounded_table() -> None:
    now = [0.0]
    throttle = security.AuthThrottle(limit=2, window=10.0, clock=lambda: now[0], max_addresses=3)
    assert throttle.retry_after("x") is None
    throttle.failed("x")
    assert throttle.retry_after("x") is None
    now[0] = 4.0
    throttle.failed("x")
    assert throttle.retry_after("x") == pytest.approx(6.0)
    now[0] = 10.0  # the first failure left the window
    assert throttle.retry_after("x") is None
    now[0] = 14.0
    assert throttle.retry_after("x") is None
    for address in ("a", "b", "c", "d"):
        throttle.failed(address)
    assert len(throttle._failures) == 3
    assert throttle.total_failures == 6
    off = security.AuthThrottle(limit=0)
    for _ in range(10):
        off.failed("x")
    assert off.retry_after("x") is None


# --- limits --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/control/update_optimizer", "/control/kick_worker"])
def test_413_oversized_control_bodies(make_server: ServerFactory, path: str) -> None:
    server = make_server()
    before = snapshot(server)
    big = b'{"lr": 0.1, "pad": "' + b"x" * (64 * 1024) + b'"}'
    resp = requests.post(url(server, path), data=big, headers=JSON, timeout=TIMEOUT)
    assert_error(resp, 413, "body_too_large")
    assert_same(before, server)


def test_413_oversized_upload(make_server: ServerFactory) -> None:
    server = make_server(num_workers=1, **EXACT)
    register(server, "a")
    before = snapshot(server)
    too_big = {"w": torch.zeros(3, 400), "b": torch.zeros(4)}  # wrong shape and far too large
    data = body("a", 0, "a-0", too_big) + b"\0" * (17 * 1024 * 1024)
    resp = requests.post(
        url(server, "/submit_pseudograd"),
        data=data,
        headers={"Content-Type": "application/octet-stream", **CLIENT},
        timeout=TIMEOUT,
    )
    assert_error(resp, 413, "body_too_large")
    assert_same(before, server)


def test_oversized_headers_are_refused_by_the_parser(make_server: ServerFactory) -> None:
    server = make_server(token=TOKEN)
    resp = requests.get(
        url(server, "/status"), headers={**AUTH, "X-Pad": "a" * 9000}, timeout=TIMEOUT
    )
    assert resp.status_code == 400
    resp = requests.get(url(server, "/status?" + "a" * 9000), headers=AUTH, timeout=TIMEOUT)
    assert resp.status_code == 400
    resp = requests.get(
        url(server, "/status"),
        headers={**AUTH, **{f"X-{i}": "1" for i in range(80)}},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 400
    assert requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT).status_code == 200


def test_unknown_paths_and_methods(make_server: ServerFactory) -> None:
    server = make_server(token=TOKEN)
    for method, path in (("GET", "/nope"), ("PUT", "/status"), ("DELETE", "/control/x")):
        resp = requests.request(method, url(server, path), headers=JSON, timeout=TIMEOUT)
        assert_error(resp, 401, "unauthorized")
        resp = requests.request(
            method, url(server, path), headers={**JSON, **AUTH}, timeout=TIMEOUT
        )
        assert_error(resp, 404, "not_found")


@pytest.mark.parametrize("path", ["/status", "/nope", "/register"])
def test_odd_expect_headers_get_417(make_server: ServerFactory, path: str) -> None:
    """Found by the fuzz test: aiohttp's own Expect handler fails with a 500 on non-UTF-8."""
    import http.client

    server = make_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Expect", b"100-\x80continue")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("X-Diloco-Client", "test")
        conn.putheader("Content-Length", "2")
        conn.endheaders(b"{}")
        resp = conn.getresponse()
        assert resp.status == 417
        assert json.loads(resp.read())["error"] == "expectation_failed"
    finally:
        conn.close()


def test_compressed_bodies_are_not_expanded(make_server: ServerFactory) -> None:
    server = make_server()
    before = snapshot(server)
    resp = requests.post(
        url(server, "/register"),
        data=gzip.compress(b'{"worker_id": "zipped"}'),
        headers={**JSON, "Content-Encoding": "gzip"},
        timeout=TIMEOUT,
    )
    assert_error(resp, 400, "bad_json")
    assert_same(before, server)


@pytest.mark.parametrize("path", ["/", "/dashboard", "/status", "/healthz"])
def test_response_headers(make_server: ServerFactory, path: str) -> None:
    server = make_server()
    resp = requests.get(url(server, path), timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.headers["X-Frame-Options"] == "DENY"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]


def test_dashboard_files_are_open_and_hold_no_data(make_server: ServerFactory) -> None:
    server = make_server(token=TOKEN, num_workers=2)
    register(server, "secret-worker-name", AUTH)
    for path in ("/", "/dashboard", "/dashboard/app.js", "/dashboard/style.css"):
        resp = requests.get(url(server, path), timeout=TIMEOUT)
        assert resp.status_code == 200, path
        assert "secret-worker-name" not in resp.text
        assert "http://" not in resp.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in resp.text


# --- TLS -----------------------------------------------------------------------------------------








def test_worker_settings_read_the_ca_from_the_environment() -> None:
    from diloco.worker.settings import resolve

    settings = resolve({}, {"DILOCO_TLS_CA": "/etc/diloco/ca.pem", "DILOCO_TOKEN": "t" * 12})
    assert settings.tls_ca == "/etc/diloco/ca.pem" and settings.token == "t" * 12
