"""The all-reduce mode's control plane over HTTP (``diloco server --allreduce``): registrations
with parameter tables, the /quorum long poll, outcomes, /status and /metrics, the parameter
routes refused, and the settings refused at start. A real server on loopback; no tensors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from diloco.cli.main import main as cli_main
from diloco.cli.status import render_status
from diloco.core.codecs import codec_by_name, codec_metadata
from diloco.server.config import ServerConfig
from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    AUTH,
    TOKEN,
    assert_error,
    body,
    post_json,
    post_raw,
    url,
)
from tests.helpers.servers import ServerFactory

TABLE = [["b", [4]], ["w", [3, 4]]]
FAST = {"poll_timeout": 2.0, "join_timeout": 0.0, "heartbeat_timeout": 0.0}


def register(
    server: DiLoCoServer, worker_id: str, table: Any = TABLE, **headers: str
) -> requests.Response:
    info = {} if table is None else {"params": table}
    return post_json(server, "/register", {"worker_id": worker_id, "info": info}, headers)


def ask(server: DiLoCoServer, worker_id: str, round_: int = 0, hash_: str = "h0") -> Any:
    body_ = {"worker_id": worker_id, "round": round_, "hash": hash_, "has_state": bool(hash_)}
    return post_json(server, "/quorum", body_)


def outcome(server: DiLoCoServer, worker_id: str, qid: str, **fields: Any) -> requests.Response:
    return post_json(
        server, "/quorum/outcome", {"worker_id": worker_id, "quorum_id": qid, **fields}
    )


def both_ask(server: DiLoCoServer, *asks: tuple[str, int, str]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(lambda a: ask(server, *a), asks))
    for resp in replies:
        assert resp.status_code == 200, resp.text
    return [r.json() for r in replies]


@pytest.fixture
def two(make_server: ServerFactory) -> DiLoCoServer:
    """A server in all-reduce mode expecting two workers, both registered."""
    server = make_server(allreduce=True, num_workers=2, **FAST)
    for worker in ("w-b", "w-a"):
        assert register(server, worker).status_code == 200
    return server


def test_registration_tells_the_mode_rendezvous_and_table(make_server: ServerFactory) -> None:
    server = make_server(allreduce=True, collective_timeout=12.5, outer_lr=0.5, **FAST)
    resp = register(server, "w-a")
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert server.front.rendezvous is not None
    assert reply["mode"] == "allreduce" and reply["has_params"] is False
    assert reply["rendezvous"] == {"path": "/rendezvous"}
    assert reply["collective_timeout"] == 12.5 and reply["round"] == 0
    assert reply["params"] == TABLE
    assert reply["outer"] == {"lr": 0.5, "momentum": 0.9, "nesterov": True}
    assert reply["instance"] == server.status()["instance"]
    # It is served there: a call reaches the store (which knows no quorum "probe" yet).
    probe = {"worker_id": "w-a", "quorum_id": "probe"}
    assert_error(post_json(server, "/rendezvous/count", probe), 404, "unknown_quorum")


def test_a_different_or_missing_table_is_refused_and_changes_nothing(
    make_server: ServerFactory,
) -> None:
    server = make_server(allreduce=True, **FAST)
    assert register(server, "w-a").status_code == 200
    reply = assert_error(
        register(server, "w-b", [["b", [4]], ["w", [4, 3]]]), 409, "params_mismatch"
    )
    assert "w has shape [4, 3]" in reply["detail"]
    reply = assert_error(register(server, "w-b", [["b", [4]]]), 409, "params_mismatch")
    assert "w missing" in reply["detail"]
    assert_error(register(server, "w-b", None), 400, "missing_params_table")
    assert_error(register(server, "w-b", [["b", ["4"]]]), 400, "bad_field")
    assert [w["worker_id"] for w in server.status()["workers"]] == ["w-a"]


@pytest.mark.parametrize(
    ("codec", "why"),
    [
        ({"codec": "lowrank"}, "not built for its collectives"),
        ({"codec": "int8", "codec_block": "128"}, "collectives use {'block': '64'}"),
        (
            {"codec": "topk", "codec_density": "0.05", "codec_index_bits": "12"},
            "collectives use {'density': '0.0156'",
        ),
    ],
)
def test_a_lossy_codec_the_collectives_lack_is_refused_naming_the_mode(
    make_server: ServerFactory, codec: dict[str, str], why: str
) -> None:
    """lowrank has no collective here, and int8, int4 and topk only their default options
    (every member must cut the same blocks or chunks): 422 at registration, nothing
    registered."""
    server = make_server(allreduce=True, **FAST)
    body = {"worker_id": "w-a", "info": {"params": TABLE, "codec": codec}}
    reply = assert_error(post_json(server, "/register", body), 422, "codec_refused")
    assert why in reply["detail"] and "--codecs" not in reply["detail"]
    assert reply["allowed"] == ["fp32", "bf16", "int8", "int4", "topk"]
    assert server.status()["workers"] == []


@pytest.mark.parametrize(
    ("codecs", "comm"),
    [
        (("int8", "int8"), "int8"),
        (("int4", "int4"), "int4"),
        (("int8", "int4"), "int8"),
        (("int4", "bf16"), "bf16"),
        (("int8", None), "fp32"),
        (("topk", "topk"), "topk"),
        (("topk", "int4"), "int4"),
    ],
)
def test_a_quorums_comm_is_the_widest_its_members_registered(
    make_server: ServerFactory, codecs: tuple[str | None, str | None], comm: str
) -> None:
    """fp32 > bf16 > int8 > int4 > topk; a member that names no codec counts as fp32."""
    server = make_server(allreduce=True, num_workers=2, **FAST)
    for worker, codec in zip(("w-a", "w-b"), codecs, strict=True):
        info: dict[str, Any] = {"params": TABLE}
        if codec is not None:
            info["codec"] = codec_metadata(codec_by_name(codec))  # what a worker sends
        resp = post_json(server, "/register", {"worker_id": worker, "info": info})
        assert resp.status_code == 200, resp.text
    qa, qb = both_ask(server, ("w-a", 0, "h0"), ("w-b", 0, "h0"))
    assert qa["comm"] == qb["comm"] == comm


def test_two_concurrent_asks_get_one_quorum_and_outcomes_complete_the_round(
    two: DiLoCoServer,
) -> None:
    qa, qb = both_ask(two, ("w-a", 0, "h0"), ("w-b", 0, "h0"))
    assert qa["quorum_id"] == qb["quorum_id"]
    assert (qa["rank"], qb["rank"], qa["size"]) == (0, 1, 2)
    assert qa["members"] == ["w-a", "w-b"]
    assert qa["rendezvous"] == {"path": "/rendezvous"}
    assert (qa["round"], qa["hash"], qa["source"], qa["resync"]) == (0, "h0", 0, [])
    st = two.status()
    assert st["mode"] == "allreduce" and st["opened"] is True
    assert st["quorum"] == {"id": qa["quorum_id"], "members": ["w-a", "w-b"], "round": 0}
    assert Status.from_json(st).to_json() == st
    assert "mode allreduce" in render_status(Status.from_json(st))  # diloco status
    qid = qa["quorum_id"]
    for worker in ("w-a", "w-b"):
        resp = outcome(two, worker, qid, ok=True, round=1, hash="h1")
        assert resp.status_code == 200 and resp.json()["status"] == "recorded", resp.text
    st = two.status()
    assert (st["round"], st["rounds_completed"], st["rounds_discarded"]) == (1, 1, 0)
    assert st["quorum"] is None and st["pending_quorum"] == []
    metrics = requests.get(url(two, "/metrics"), timeout=10).text
    assert "diloco_rounds_discarded_total 0" in metrics and "diloco_quorum_size 0" in metrics
    assert 'diloco_info{mode="allreduce"' in metrics
    # The next quorum starts from the recorded state; a worker that missed it is resynced.
    qa, qb = both_ask(two, ("w-a", 1, "h1"), ("w-b", 0, "h0"))
    assert (qa["round"], qa["hash"], qa["source"], qa["resync"]) == (1, "h1", 0, [1])


def test_a_lone_ask_is_pending_and_a_departure_discards_the_quorum(two: DiLoCoServer) -> None:
    resp = ask(two, "w-a")
    assert resp.status_code == 202 and resp.json() == {"status": "pending", "round": 0}
    qa, _ = both_ask(two, ("w-a", 0, "h0"), ("w-b", 0, "h0"))
    assert post_json(two, "/deregister", {"worker_id": "w-b"}).status_code == 200
    st = two.status()
    assert (st["rounds_discarded"], st["quorum"]) == (1, None)
    reply = outcome(two, "w-a", qa["quorum_id"], ok=True, round=1, hash="h1").json()
    assert reply["status"] == "discarded" and "w-b" in reply["detail"]
    metrics = requests.get(url(two, "/metrics"), timeout=10).text
    assert "diloco_rounds_discarded_total 1" in metrics


def test_quorum_errors(two: DiLoCoServer) -> None:
    assert_error(ask(two, "w-nobody"), 410, "unknown_worker")
    assert_error(outcome(two, "w-a", "elsewhere-1", ok=False, error="x"), 404, "unknown_quorum")
    assert_error(post_json(two, "/quorum", {"worker_id": "w-a", "round": -1}), 400, "bad_field")
    qa, _ = both_ask(two, ("w-a", 0, "h0"), ("w-b", 0, "h0"))
    assert register(two, "w-c").status_code == 200
    assert_error(
        outcome(two, "w-c", qa["quorum_id"], ok=True, round=1, hash="h"), 409, "not_a_member"
    )
    big = {"worker_id": "w-a", "round": 0, "hash": "h" * 70_000}
    assert_error(post_json(two, "/quorum", big), 413, "body_too_large")
    assert two.status()["quorum"] is not None  # nothing refused changed it


def test_the_parameter_routes_are_refused(two: DiLoCoServer) -> None:
    resp = post_raw(two, "/submit_pseudograd", body("w-a", 0, "s1"))
    assert "all-reduce" in assert_error(resp, 409, "allreduce_mode")["detail"]
    assert_error(
        post_raw(two, "/initial_params?worker_id=w-a", body(None, None, None)),
        409,
        "allreduce_mode",
    )
    resp = requests.get(url(two, "/global_params?worker_id=w-a"), timeout=10)
    assert_error(resp, 409, "allreduce_mode")
    resp = post_json(two, "/control/update_optimizer", {"lr": 0.1})
    assert_error(resp, 409, "allreduce_mode")
    resp = post_json(two, "/control/save_state", {})
    assert resp.status_code == 202 and resp.json()["status"] == "requested"
    qa, _ = both_ask(two, ("w-a", 0, "h0"), ("w-b", 0, "h0"))
    assert qa["save"] is True


def test_auth_applies_and_server_mode_refuses_quorums(make_server: ServerFactory) -> None:
    server = make_server(allreduce=True, token=TOKEN, **FAST)
    assert_error(register(server, "w-a"), 401, "unauthorized")
    assert register(server, "w-a", **AUTH).status_code == 200
    assert_error(ask(server, "w-a"), 401, "unauthorized")
    plain = make_server(num_workers=1)
    reply = post_json(plain, "/register", {"worker_id": "w-a"}).json()
    assert reply["mode"] == "sync"
    assert_error(ask(plain, "w-a"), 409, "server_mode")


def test_the_rendezvous_closes_with_the_server(make_server: ServerFactory) -> None:
    server = make_server(allreduce=True, **FAST)
    assert server.front.rendezvous is not None
    server.stop()
    assert server.front.rendezvous is None


@pytest.mark.parametrize(
    ("settings", "flag"),
    [
        ({"mode": "async"}, "--async"),
        ({"download_codec": "int8"}, "--download-codec"),
        ({"initial_params": "model.safetensors"}, "--init"),
        ({"save_dir": "ckpt"}, "--save-dir"),
        ({"trim_fraction": 0.2}, "--trim-fraction"),
    ],
)
def test_settings_all_reduce_cannot_take_are_refused(settings: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerConfig(allreduce=True, **settings)
    ServerConfig(**settings)  # fine without --allreduce


def test_the_cli_refuses_them_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["server", "--allreduce", "--async", "--port", "0"]) == 2
    assert "--async" in capsys.readouterr().err
    with pytest.raises(ValueError, match="collective_timeout"):
        ServerConfig(allreduce=True, collective_timeout=0)
