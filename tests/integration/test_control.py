"""``/control/*`` against a real server: each action does what it says, bad bodies change
nothing, shutdown stops the server (saving first unless told not to), and the log names the
worker and the round."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import requests

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from tests.helpers.http import EXACT, TIMEOUT, accept, assert_error, body, register, url, wait_round
from tests.helpers.security import JSON, assert_same, snapshot
from tests.helpers.servers import ServerFactory


def control(server: DiLoCoServer, action: str, payload: Any) -> requests.Response:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return requests.post(
        url(server, f"/control/{action}"), data=data, headers=JSON, timeout=TIMEOUT
    )


def ok(resp: requests.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_save_state(make_server: ServerFactory, tmp_path: Path) -> None:
    server = make_server(save_dir=str(tmp_path), **EXACT)
    register(server, "a")
    accept(server, body("a", 0, "a-0", seed=1))
    wait_round(server, 1)
    reply = ok(control(server, "save_state", {}))
    assert reply["status"] == "ok" and reply["round"] == 1
    saved = Path(reply["path"])
    assert saved.parent == tmp_path and (saved / "params.safetensors").is_file()
    assert server.status()["last_save"]["round"] == 1


def test_save_state_without_a_save_dir(make_server: ServerFactory) -> None:
    server = make_server()
    assert_error(control(server, "save_state", {}), 409, "no_save_dir")


def test_save_state_with_nothing_to_save(tmp_path: Path) -> None:
    with DiLoCoServer(ServerConfig(port=0, save_dir=str(tmp_path))) as server:
        assert_error(control(server, "save_state", {}), 409, "nothing_to_save")


def test_kick_worker(make_server: ServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", seed=1))
    with caplog.at_level(logging.INFO, logger="diloco"):
        reply = ok(control(server, "kick_worker", {"worker_id": "b"}))
    assert reply["kicked"] == "b"
    # b left the expected set: the round closes with a's contribution alone.
    st = wait_round(server, 1)
    assert [w["worker_id"] for w in st["workers"]] == ["a"]
    assert st["worker_deaths"] == 0  # an operator's kick is not a death
    kicked = [r.getMessage() for r in caplog.records if "kicked" in r.getMessage()]
    assert kicked and "b" in kicked[0] and "round 0" in kicked[0]
    # The kicked worker is told it is unknown, and may join again.
    resp = requests.post(
        url(server, "/heartbeat"), json={"worker_id": "b"}, headers=JSON, timeout=TIMEOUT
    )
    assert_error(resp, 410, "unknown_worker")


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        ({"worker_id": "nobody"}, 410, "unknown_worker"),
        ({}, 400, "bad_field"),
        ({"worker_id": 3}, 400, "bad_field"),
        ({"worker_id": "a", "force": True}, 400, "bad_field"),
        (b"[]", 400, "bad_json"),
        (b"not json", 400, "bad_json"),
    ],
)
def test_kick_worker_refusals_change_nothing(
    make_server: ServerFactory, payload: Any, status: int, code: str
) -> None:
    server = make_server(num_workers=2)
    register(server, "a")
    before = snapshot(server)
    assert_error(control(server, "kick_worker", payload), status, code)
    assert_same(before, server)


def test_update_optimizer(make_server: ServerFactory) -> None:
    server = make_server()
    register(server, "a")  # the run's outer optimizers exist once a worker has set it up
    reply = ok(control(server, "update_optimizer", {"lr": 0.25}))
    assert reply["outer_optimizer"]["lr"] == 0.25
    reply = ok(control(server, "update_optimizer", {"momentum": 0.5}))
    assert reply["outer_optimizer"] == {**reply["outer_optimizer"], "lr": 0.25, "momentum": 0.5}
    groups = server.front.outer_optimizers()[0].param_groups
    assert all(g["lr"] == 0.25 and g["momentum"] == 0.5 for g in groups)
    ok(control(server, "update_optimizer", {"lr": 3, "momentum": 0}))
    assert server.status()["outer_optimizer"]["lr"] == 3.0


BAD_OPTIMIZER = {
    "zero_lr": b'{"lr": 0}',
    "negative_lr": b'{"lr": -0.1}',
    "nan_lr": b'{"lr": NaN}',
    "inf_lr": b'{"lr": Infinity}',
    "string_lr": b'{"lr": "0.1"}',
    "bool_lr": b'{"lr": true}',
    "momentum_one": b'{"momentum": 1.0}',
    "negative_momentum": b'{"momentum": -0.5}',
    "nan_momentum": b'{"momentum": NaN}',
    "neither": b"{}",
    "unknown_field": b'{"lr": 0.1, "beta": 0.9}',
    "good_lr_bad_momentum": b'{"lr": 0.1, "momentum": 2}',
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIMIZER))
def test_update_optimizer_refusals_change_nothing(make_server: ServerFactory, case: str) -> None:
    server = make_server()
    before = snapshot(server)
    assert_error(control(server, "update_optimizer", BAD_OPTIMIZER[case]), 400, "bad_field")
    assert_same(before, server)


def test_update_num_workers_opens_round0(make_server: ServerFactory) -> None:
    server = make_server(num_workers=3)
    register(server, "a")
    register(server, "b")
    assert server.status()["opened"] is False
    assert ok(control(server, "update_num_workers", {"num_workers": 2}))["num_workers"] == 2
    st = server.status()
    assert st["opened"] is True and sorted(st["expected"]) == ["a", "b"]
    assert ok(control(server, "update_num_workers", {"num_workers": 5}))["num_workers"] == 5


@pytest.mark.parametrize(
    "payload",
    [{"num_workers": 0}, {"num_workers": 1}, {"num_workers": 2.5}, {"num_workers": "3"},
     {"num_workers": True}, {}, {"num_workers": 3, "x": 1}],
)  # fmt: skip
def test_update_num_workers_refusals_change_nothing(
    make_server: ServerFactory, payload: dict[str, Any]
) -> None:
    server = make_server(num_workers=3, min_workers=2)
    before = snapshot(server)
    assert_error(control(server, "update_num_workers", payload), 400, "bad_field")
    assert_same(before, server)


@pytest.mark.parametrize("save", [True, False])
def test_shutdown(make_server: ServerFactory, tmp_path: Path, save: bool) -> None:
    server = make_server(save_dir=str(tmp_path), num_workers=2)
    register(server, "a")
    reply = ok(control(server, "shutdown", {"save": save}))
    assert reply == {"status": "shutting_down", "save": save, "round": 0}
    assert server.wait_stopped(TIMEOUT)
    with pytest.raises(requests.ConnectionError):
        requests.get(url(server, "/healthz"), timeout=TIMEOUT)
    assert any(tmp_path.glob("round-*")) is save
    server.stop()  # after a remote shutdown, stop() is a no-op


def test_shutdown_refusals_keep_serving(make_server: ServerFactory) -> None:
    server = make_server()
    assert_error(control(server, "shutdown", {"save": "yes"}), 400, "bad_field")
    assert_error(control(server, "shutdown", {"now": True}), 400, "bad_field")
    assert not server.wait_stopped(0)
    assert requests.get(url(server, "/healthz"), timeout=TIMEOUT).status_code == 200


def test_control_before_any_parameters() -> None:
    with DiLoCoServer(ServerConfig(port=0)) as server:
        assert_error(control(server, "update_optimizer", {"lr": 0.1}), 503, "no_parameters")


def test_metrics_endpoint(make_server: ServerFactory) -> None:
    from tests.helpers.metrics import parse, value

    server = make_server(token="metrics-token-1", **EXACT)
    auth = {"Authorization": "Bearer metrics-token-1"}
    register(server, "a", auth)
    accept(server, body("a", 0, "a-0", seed=1), auth)
    wait_round(server, 1)
    requests.get(url(server, "/status"), timeout=TIMEOUT)  # one refused request, counted
    resp = requests.get(url(server, "/metrics"), headers=auth, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    s = parse(resp.text)
    assert value(s, "diloco_round") == 1
    assert value(s, "diloco_workers_live") == 1
    assert value(s, "diloco_registrations_total") == 1
    assert value(s, "diloco_bytes_in_total") == server.status()["bytes_in"] > 0
    assert value(s, "diloco_outer_lr") == 1.0
    assert value(s, "diloco_auth_failures_total") == 1
    assert value(s, "diloco_http_responses_total", 'code="401"') == 1
