"""Async mode, Delayed Nesterov, DyLU and per-fragment rounds through a real server on loopback,
each against arithmetic written out here (not the server's own code)."""

from __future__ import annotations

import math
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import requests
import safetensors.torch
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.wire import encode
from tests.helpers.fragments import FRAG2, in_fragment
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    assert_error,
    assert_unchanged,
    body,
    parse_safetensors_metadata,
    post_json,
    pseudo_grad,
    state,
    submit,
    url,
)
from tests.helpers.servers import ServerFactory, initial_params

ASYNC = {"mode": "async", "num_workers": 2}


def join(server: DiLoCoServer, worker_id: str, **info: Any) -> dict[str, Any]:
    resp = post_json(server, "/register", {"worker_id": worker_id, "info": info})
    assert resp.status_code == 200, resp.text
    return resp.json()


def nesterov_reference(
    params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lr: float, beta: float
) -> dict[str, torch.Tensor]:
    """SGD with Nesterov momentum, one step per arrival, written out."""
    p = {n: t.clone() for n, t in params.items()}
    m: dict[str, torch.Tensor] = {}
    for g in grads:
        for n in p:
            m[n] = g[n].clone() if n not in m else beta * m[n] + g[n]
            p[n] = p[n] - lr * (g[n] + beta * m[n])
    return p


# --- async mode ----------------------------------------------------------------------------------


def test_async_applies_each_arrival_and_records_staleness(make_server: ServerFactory) -> None:
    server = make_server(**ASYNC)
    assert join(server, "a")["mode"] == "async"
    join(server, "b")
    old = server.global_params()
    # a and b both trained from version 0; a arrives first, b's arrival is one update stale.
    ra = accept(server, body("a", 0, "a-0", seed=1))
    assert (ra["round"], ra["version"], ra["staleness"]) == (0, 1, 0)
    rb = accept(server, body("b", 0, "b-0", seed=2))
    assert (rb["round"], rb["version"], rb["staleness"]) == (1, 2, 1)
    # a fetched version 1 and trains on; its next arrival is one update stale too.
    ra2 = accept(server, body("a", 1, "a-1", seed=3))
    assert (ra2["version"], ra2["staleness"]) == (3, 1)
    want = nesterov_reference(old, [pseudo_grad(1), pseudo_grad(2), pseudo_grad(3)], 0.7, 0.9)
    got = server.global_params()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)
    st = server.status()
    assert st["mode"] == "async" and st["round"] == 3
    assert st["staleness"] == {"last": 1, "mean": round(2 / 3, 4), "max": 1, "count": 3, "gated": 0}
    workers = {w["worker_id"]: w for w in st["workers"]}
    assert workers["a"]["staleness"] == 1 and workers["b"]["staleness"] == 1
    assert [e["staleness"] for e in st["update_log"]] == [0, 1, 1]
    # The download names the version it holds.
    resp = requests.get(url(server, "/global_params?min_round=3"), timeout=TIMEOUT)
    assert parse_safetensors_metadata(resp.content)["round"] == "3"


def test_async_inverse_sqrt_weighting(make_server: ServerFactory) -> None:
    server = make_server(staleness_weighting="inverse_sqrt", **ASYNC, **EXACT)
    join(server, "a")
    join(server, "b")
    old = server.global_params()
    accept(server, body("a", 0, "a-0", seed=1))
    reply = accept(server, body("b", 0, "b-0", seed=2))
    assert reply["weight"] == pytest.approx(1 / math.sqrt(2))
    ga, gb = pseudo_grad(1), pseudo_grad(2)
    got = server.global_params()
    for name in old:
        want = old[name] - ga[name] - gb[name] / math.sqrt(2.0)
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


def test_async_max_staleness_refuses_with_409_and_changes_nothing(
    make_server: ServerFactory,
) -> None:
    server = make_server(max_staleness=1, **ASYNC)
    join(server, "a")
    join(server, "b")
    accept(server, body("a", 0, "a-0", seed=1))
    accept(server, body("a", 1, "a-1", seed=2))
    before = state(server)
    reply = assert_error(submit(server, body("b", 0, "b-0", seed=3)), 409, "too_stale")
    assert (reply["action"], reply["round"], reply["staleness"]) == ("rebase", 2, 2)
    assert_unchanged(before, server)
    assert server.status()["rejected_submissions"] == 1
    accept(server, body("b", 1, "b-1", seed=3))  # one update old: within the bound


def test_async_duplicate_and_future(make_server: ServerFactory) -> None:
    server = make_server(**ASYNC)
    join(server, "a")
    accept(server, body("a", 0, "a-0", seed=1))
    before = state(server)
    dup = submit(server, body("a", 0, "a-0", seed=1))
    assert dup.status_code == 200
    assert dup.json()["status"] == "duplicate" and dup.json()["version"] == 1
    reply = assert_error(submit(server, body("a", 5, "a-5", seed=2)), 409, "future_round")
    assert reply["action"] == "rebase" and reply["round"] == 1
    assert_unchanged(before, server)


def dn_reference(
    params: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    lr: float,
    beta: float,
    n: int,
    c: float,
) -> dict[str, torch.Tensor]:
    """Algorithm 3 of arXiv 2401.09135, written out independently of core.delayed_nesterov."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    d = {k: torch.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            d[k] = d[k] + g[k]
            if t % n == 0:
                m[k] = beta * m[k] + d[k] / n
                p[k] = p[k] - lr * ((1 - c * n + c) * beta * m[k] + g[k] / n)
                d[k] = torch.zeros_like(d[k])
            else:
                p[k] = p[k] - lr * (c * beta * m[k] + g[k] / n)
    return p


@pytest.mark.parametrize(("n", "c"), [(2, 0.0), (3, 0.2)])
def test_async_delayed_nesterov_through_the_server(
    make_server: ServerFactory, n: int, c: float
) -> None:
    server = make_server(
        delayed_nesterov=True, dn_buffer_size=n, dn_activation=c, mode="async", num_workers=n
    )
    for w in range(n):
        join(server, f"w{w}")
    old = server.global_params()
    seeds = [1, 2, 3, 4, 5, 6, 7]
    for i, seed in enumerate(seeds):
        accept(server, body(f"w{i % n}", i, f"s-{i}", seed=seed))
    want = dn_reference(old, [pseudo_grad(s) for s in seeds], 0.7, 0.9, n, c)
    got = server.global_params()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    st = server.status()
    assert st["outer_optimizer_class"] == "DelayedNesterov"
    assert st["delayed_nesterov"] == {"buffer_size": n, "activation": c}


def test_async_options_need_async_mode() -> None:
    with pytest.raises(ValueError, match="async"):
        ServerConfig(delayed_nesterov=True)
    with pytest.raises(ValueError, match=r"\[0, 1/N\]"):
        ServerConfig(mode="async", delayed_nesterov=True, dn_buffer_size=2, dn_activation=0.6)


# --- DyLU ----------------------------------------------------------------------------------------


def beat(server: DiLoCoServer, worker_id: str, **fields: Any) -> dict[str, Any]:
    resp = post_json(server, "/heartbeat", {"worker_id": worker_id, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_dylu_recommends_sync_every_from_smoothed_speeds(make_server: ServerFactory) -> None:
    server = make_server(dylu=True, dylu_min_sync_every=4, **ASYNC)
    assert join(server, "fast", sync_every=100)["recommended_sync_every"] == 100
    join(server, "slow", sync_every=100)
    assert beat(server, "fast", steps_per_second=10.0)["recommended_sync_every"] == 100
    assert beat(server, "slow", steps_per_second=2.5)["recommended_sync_every"] == 25
    # Right after a sync a worker reports no speed, or 0: the recommendation holds.
    assert beat(server, "slow", steps_per_second=0.0)["recommended_sync_every"] == 25
    assert beat(server, "slow")["recommended_sync_every"] == 25
    # A faster sample moves the smoothed speed part of the way: 0.7 * 2.5 + 0.3 * 5 = 3.25.
    assert beat(server, "slow", steps_per_second=5.0)["recommended_sync_every"] == 32
    # Never below the minimum.
    join(server, "crawl", sync_every=100)
    assert beat(server, "crawl", steps_per_second=0.1)["recommended_sync_every"] == 4
    workers = {w["worker_id"]: w for w in server.status()["workers"]}
    assert workers["slow"]["smoothed_speed"] == pytest.approx(3.25)
    assert workers["slow"]["recommended_sync_every"] == 32


def test_dylu_base_sync_every_on_the_server_overrides_the_workers_own(
    make_server: ServerFactory,
) -> None:
    # The reference's `--dylu --dylu-base-sync-every 500`: the fastest worker gets 500 whatever
    # sync_every it registered with, the others their share of it.
    server = make_server(dylu=True, dylu_base_sync_every=500, **ASYNC)
    assert join(server, "fast", sync_every=100)["recommended_sync_every"] == 500
    join(server, "slow", sync_every=40)
    assert beat(server, "fast", steps_per_second=10.0)["recommended_sync_every"] == 500
    assert beat(server, "slow", steps_per_second=2.5)["recommended_sync_every"] == 125


def test_no_recommendation_without_dylu(make_server: ServerFactory) -> None:
    server = make_server(**ASYNC)
    assert "recommended_sync_every" not in join(server, "a", sync_every=100)
    assert "recommended_sync_every" not in beat(server, "a", steps_per_second=3.0)


# --- fragments -----------------------------------------------------------------------------------



def fragment_body(
    reply: dict[str, Any],
    k: int,
    worker_id: str,
    base: int,
    sid: str,
    full: dict[str, torch.Tensor],
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The pieces of fragment ``k`` cut from a full pseudo-gradient."""
    pieces = {
        wire: full[param].reshape(-1)[start:stop].clone()
        for wire, param, start, stop in reply["fragments"][k]
    }
    meta = {
        "worker_id": worker_id,
        "base_round": str(base),
        "submission_id": sid,
        "fragment": str(k),
    }
    return encode(pieces, meta), pieces




def test_sync_fragments_have_their_own_rounds(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, poll_timeout=0.2, **EXACT)
    ra = join(server, "a", **FRAG2)
    join(server, "b", **FRAG2)
    assert ra["fragment_rounds"] == [0, 0] and len(ra["fragments"]) == 2
    sizes = [sum(stop - start for _, _, start, stop in f) for f in ra["fragments"]]
    assert sizes == [8, 8]  # 12 + 4 elements, split evenly
    old = server.global_params()
    ga, gb = pseudo_grad(1), pseudo_grad(2)
    for w, g in (("a", ga), ("b", gb)):
        data, _ = fragment_body(ra, 0, w, 0, f"{w}-f0", g)
        reply = accept(server, data)
        assert reply["fragment"] == 0
    got = requests.get(
        url(server, "/global_params?fragment=0&min_round=1&worker_id=a"), timeout=TIMEOUT
    )
    assert got.status_code == 200
    meta = parse_safetensors_metadata(got.content)
    assert (meta["round"], meta["fragment"]) == ("1", "0")
    pieces = safetensors.torch.load(got.content)
    assert set(pieces) == {wire for wire, *_ in ra["fragments"][0]}
    new = server.global_params()
    for name in old:
        mask = in_fragment(ra, 0, name, old[name].shape)
        want = torch.where(mask, old[name] - (ga[name] + gb[name]) / 2, old[name])
        torch.testing.assert_close(new[name], want, rtol=1e-6, atol=1e-6)
    for wire, param, start, stop in ra["fragments"][0]:
        torch.testing.assert_close(pieces[wire], new[param].reshape(-1)[start:stop])
    st = server.status()
    assert [f["round"] for f in st["fragments"]] == [1, 0]
    full = requests.get(url(server, "/global_params"), timeout=TIMEOUT)
    assert parse_safetensors_metadata(full.content)["fragment_rounds"] == "1,0"
    # Fragment 1 still waits at round 0; a long poll for its round 1 is pending.
    pending = requests.get(url(server, "/global_params?fragment=1&min_round=1"), timeout=TIMEOUT)
    assert pending.status_code == 202 and pending.json()["fragment"] == 1


def test_fragment_requests_are_validated(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    ra = join(server, "a", **FRAG2)
    join(server, "b", **FRAG2)
    before = state(server)
    # Another fragmenting: 409 with what to do; the registry is unchanged.
    resp = post_json(server, "/register", {"worker_id": "c", "info": {"num_fragments": 1}})
    reply = assert_error(resp, 409, "fragments_mismatch")
    assert reply["action"] == "reconfigure" and reply["fragments"] == 2
    g = pseudo_grad(1)
    data, pieces = fragment_body(ra, 0, "a", 0, "a-f0", g)
    # Fragment 0's pieces labelled as fragment 1: the names do not match its table.
    wrong = encode(
        pieces, {"worker_id": "a", "base_round": "0", "submission_id": "x", "fragment": "1"}
    )
    assert submit(server, wrong).status_code == 400
    no_frag = encode(pieces, {"worker_id": "a", "base_round": "0", "submission_id": "y"})
    assert_error(submit(server, no_frag), 400, "missing_metadata")
    bad = encode(
        pieces, {"worker_id": "a", "base_round": "0", "submission_id": "z", "fragment": "7"}
    )
    assert_error(submit(server, bad), 400, "bad_fragment")
    resp = requests.get(url(server, "/global_params?fragment=2"), timeout=TIMEOUT)
    assert_error(resp, 400, "bad_fragment")
    assert_unchanged(before, server)


def test_async_fragments_apply_per_fragment_with_delayed_nesterov(
    make_server: ServerFactory,
) -> None:
    server = make_server(delayed_nesterov=True, dn_buffer_size=2, **ASYNC)
    ra = join(server, "a", **FRAG2)
    join(server, "b", **FRAG2)
    old = server.global_params()
    g1, g2, g3 = pseudo_grad(1), pseudo_grad(2), pseudo_grad(3)
    for sid, (w, k, base, g) in enumerate([("a", 1, 0, g1), ("b", 1, 0, g2), ("a", 0, 0, g3)]):
        data, _ = fragment_body(ra, k, w, base, f"s{sid}", g)
        accept(server, data)
    assert [f["round"] for f in server.status()["fragments"]] == [1, 2]
    got = server.global_params()
    for name in old:
        # Each fragment has its own DN state: fragment 1 saw two arrivals, fragment 0 one.
        f1 = dn_reference({name: old[name]}, [{name: g1[name]}, {name: g2[name]}], 0.7, 0.9, 2, 0)
        f0 = dn_reference({name: old[name]}, [{name: g3[name]}], 0.7, 0.9, 2, 0)
        m0 = in_fragment(ra, 0, name, old[name].shape)
        want = torch.where(m0, f0[name], f1[name])
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fragment_state_survives_a_restart(tmp_path: Path, mode: str) -> None:
    extra: dict[str, Any] = (
        {"delayed_nesterov": True, "dn_buffer_size": 2} if mode == "async" else {}
    )
    cfg = ServerConfig(port=0, num_workers=1, mode=mode, save_dir=str(tmp_path), **extra)
    grads = [pseudo_grad(s) for s in (1, 2, 3, 4)]

    def run(
        server: DiLoCoServer, reply: dict[str, Any], plan: list[tuple[int, int]], first: int = 0
    ) -> None:
        for i, (k, base) in enumerate(plan, start=first):
            data, _ = fragment_body(reply, k, "a", base, f"{mode}-{k}-{base}", grads[i])
            accept(server, data)
            resp = requests.get(
                url(server, f"/global_params?fragment={k}&min_round={base + 1}"), timeout=TIMEOUT
            )
            assert resp.status_code == 200

    first = [(0, 0), (1, 0), (0, 1)]
    with DiLoCoServer(cfg, initial_params=initial_params()) as srv:
        reply = join(srv, "a", **FRAG2)
        run(srv, reply, first)
        st = srv.status()
        assert [f["round"] for f in st["fragments"]] == [2, 1]
    # The shutdown saved; a new server resumes every fragment's round and optimizer state.
    with DiLoCoServer(cfg) as again:
        reply2 = join(again, "a", **FRAG2)
        assert reply2["fragments"] == reply["fragments"] and reply2["fragment_rounds"] == [2, 1]
        # A receipt survives: a retry of a counted submission is a duplicate, not a new update.
        data, _ = fragment_body(reply2, 0, "a", 1, f"{mode}-0-1", grads[2])
        assert submit(again, data).json()["status"] == "duplicate"
        run(again, reply2, [(1, 1)], first=3)
        resumed = again.global_params()
    # The same four updates without a restart.
    other = tmp_path / "straight"
    with DiLoCoServer(
        ServerConfig(port=0, num_workers=1, mode=mode, save_dir=str(other), **extra),
        initial_params=initial_params(),
    ) as straight:
        reply3 = join(straight, "a", **FRAG2)
        run(straight, reply3, [*first, (1, 1)])
        for name, t in straight.global_params().items():
            assert torch.equal(resumed[name], t), name


def test_restart_refuses_another_mode(tmp_path: Path) -> None:
    with DiLoCoServer(
        ServerConfig(port=0, num_workers=1, save_dir=str(tmp_path)), initial_params=initial_params()
    ) as srv:
        join(srv, "a")
        srv.save_state()
    with pytest.raises(ValueError, match="sync mode"):
        DiLoCoServer(ServerConfig(port=0, num_workers=1, mode="async", save_dir=str(tmp_path)))


def test_async_update_does_not_wait_for_a_stalled_download(make_server: ServerFactory) -> None:
    """A client that stops reading mid-download holds no lock: submissions are applied
    meanwhile (to a copy of the parameters), and the stalled client still gets the bytes of the
    version it asked for."""
    big = {"w": torch.zeros(8 * 1024 * 1024)}  # 32 MiB: far more than the socket buffers
    server = make_server(params=big, mode="async", outer_lr=1.0, outer_momentum=0.0)
    join(server, "a")
    host, port = server.address.split(":")
    stalled = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    try:
        stalled.sendall(f"GET /global_params HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        first = stalled.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        for v in range(3):  # each applied at once, while the download above sits half-sent
            accept(
                server,
                encode(
                    {"w": torch.full((8 * 1024 * 1024,), -1.0)},
                    {"worker_id": "a", "base_round": str(v), "submission_id": f"s{v}"},
                ),
            )
        st = server.status()
        assert st["round"] == 3 and st["copies_on_write"] >= 1
        received = bytearray(first)
        while True:
            chunk = stalled.recv(1 << 20)
            if not chunk:
                break
            received += chunk
            head, _, body_bytes = bytes(received).partition(b"\r\n\r\n")
            length = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
            if len(body_bytes) >= length:
                break
        old = safetensors.torch.load(body_bytes[:length])
        assert parse_safetensors_metadata(body_bytes)["round"] == "0"
        assert torch.equal(old["w"], big["w"])  # the version it asked for, not a mix
    finally:
        stalled.close()
    assert torch.equal(server.global_params()["w"], torch.full((8 * 1024 * 1024,), 3.0))
