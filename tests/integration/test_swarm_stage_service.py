"""One stage service over HTTP (issue 29): bad input is refused with a clear code and changes
nothing, strangers are refused before their body is read, retries run once."""

from __future__ import annotations

import copy
import json
import socket
import threading

import torch
from torch import nn

from diloco.swarm import BoundaryCodec, BoundarySpec, StageEdges, StageService
from tests.helpers.swarm import HIDDEN, TOKEN, make_optimizer, post

SPEC = BoundarySpec("0->1", (HIDDEN,))
OUT = BoundarySpec("1->2", (HIDDEN,))


def _service(**kw: object) -> tuple[StageService, list[int]]:
    torch.manual_seed(0)
    stage = nn.Linear(HIDDEN, HIDDEN)
    runs: list[int] = []
    stage.register_forward_hook(lambda *_: runs.append(1))
    edges = StageEdges(
        (BoundaryCodec(SPEC, "fp32"), BoundaryCodec(SPEC, "fp32")),
        (BoundaryCodec(OUT, "fp32"), BoundaryCodec(OUT, "fp32")),
    )
    settings: dict = {"samples_per_step": 8, "token": TOKEN, **kw}
    return StageService(stage, make_optimizer(stage), edges, **settings).start(), runs


def _body(spec: BoundarySpec, t: torch.Tensor) -> bytes:
    return BoundaryCodec(spec, "fp32").encode(t)


def test_a_wrong_shape_is_a_400_naming_the_boundary_and_changes_nothing() -> None:
    service, runs = _service()
    try:
        bad = BoundaryCodec(BoundarySpec("0->1", (HIDDEN + 1,)), "fp32").encode(
            torch.randn(4, HIDDEN + 1)
        )
        r = post(service, "forward", bad, call="c1", samples=4)
        assert r.status_code == 400
        reply = r.json()
        assert reply["error"] == "bad_boundary"
        assert "0->1" in reply["detail"]
        assert f"[batch, {HIDDEN}]" in reply["detail"] and f"[4, {HIDDEN + 1}]" in reply["detail"]
        assert runs == [] and service.stats()["held"] == 0
        # A good forward, then a backward whose gradient has the wrong batch: refused, nothing
        # accumulated, and the call still held for a correct backward.
        assert post(
            service, "forward", _body(SPEC, torch.randn(4, HIDDEN)), call="c2", samples=4
        ).ok
        r = post(service, "backward", _body(OUT, torch.randn(3, HIDDEN)), call="c2")
        assert r.status_code == 400 and r.json()["error"] == "bad_boundary"
        assert "[4, 32]" in r.json()["detail"] and "[3, 32]" in r.json()["detail"]
        assert all(p.grad is None for p in service.stage.parameters())
        assert service.stats()["held"] == 1
        # Garbage, another codec, a bad query: 400s of their own.
        assert post(service, "forward", b"junk", call="c3", samples=4).status_code == 400
        bf16 = BoundaryCodec(SPEC, "bf16").encode(torch.randn(4, HIDDEN))
        assert (
            post(service, "forward", bf16, call="c3", samples=4).json()["error"] == "bad_boundary"
        )
        good = _body(SPEC, torch.randn(4, HIDDEN))
        assert post(service, "forward", good, call="c 3", samples=4).json()["error"] == "bad_call"
        assert post(service, "forward", good, call="c3", samples=5).json()["error"] == "bad_samples"
        assert post(service, "forward", good, call="c3", samples=0).json()["error"] == "bad_query"
        assert len(runs) == 1
    finally:
        service.stop()


def test_strangers_get_401_and_big_bodies_413() -> None:
    service, runs = _service(max_body_bytes=4096)
    try:
        body = _body(SPEC, torch.randn(4, HIDDEN))
        assert post(service, "forward", body, token=None, call="c", samples=4).status_code == 401
        assert post(service, "forward", body, token="wrong", call="c", samples=4).status_code == 401
        assert post(service, "backward", body, token=None, call="c").status_code == 401
        big = _body(SPEC, torch.randn(64, HIDDEN))
        assert post(service, "forward", big, call="c", samples=64).status_code == 413
        assert runs == [] and service.stats()["held"] == 0
    finally:
        service.stop()


def test_retried_forward_and_backward_run_once() -> None:
    """The same call id again gets the same reply; the stage ran forward once and accumulated
    the gradient once (a second application would double it)."""
    service, runs = _service()
    try:
        x = _body(SPEC, torch.randn(4, HIDDEN))
        first = post(service, "forward", x, call="c1", samples=4)
        again = post(service, "forward", x, call="c1", samples=4)
        assert first.ok and again.content == first.content and len(runs) == 1
        g = _body(OUT, torch.randn(4, HIDDEN))
        back = post(service, "backward", g, call="c1")
        assert back.ok
        grads = [copy.deepcopy(p.grad) for p in service.stage.parameters()]
        back_again = post(service, "backward", g, call="c1")
        assert back_again.content == back.content
        after = [p.grad for p in service.stage.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))
        stats = service.stats()
        assert stats["retries"] == 2 and stats["pending_samples"] == 4 and stats["steps"] == 0
        # A forward of a finished call is refused; an unknown call's backward is a 404.
        assert post(service, "forward", x, call="c1", samples=4).status_code == 409
        r = post(service, "backward", g, call="never")
        assert r.status_code == 404 and r.json()["error"] == "unknown_call"
    finally:
        service.stop()


def test_the_stage_steps_when_its_samples_are_in_and_drops_the_oldest_call() -> None:
    service, runs = _service(max_calls=2)
    try:
        before = copy.deepcopy(service.stage.state_dict())
        for c in ("a", "b", "c"):
            x = _body(SPEC, torch.randn(4, HIDDEN))
            assert post(service, "forward", x, call=c, samples=4).ok
        assert service.stats()["dropped"] == 1  # "a" made room for "c"
        g = _body(OUT, torch.randn(4, HIDDEN))
        assert post(service, "backward", g, call="a").status_code == 404
        assert post(service, "backward", g, call="b").ok
        assert service.stats()["steps"] == 0
        assert all(torch.equal(before[n], p) for n, p in service.stage.state_dict().items())
        assert post(service, "backward", g, call="c").ok
        assert service.stats()["steps"] == 1  # 8 samples: one step, then the gradients zeroed
        assert all(p.grad is None or not p.grad.any() for p in service.stage.parameters())
        assert not torch.equal(before["weight"], service.stage.weight)
        traffic = service.stats()["traffic"]
        assert traffic["0->1:in:forward"]["tokens"] == 12
        assert json.loads(json.dumps(traffic)) == traffic
    finally:
        service.stop()


def test_strangers_holding_connections_cannot_keep_a_token_holder_out() -> None:
    """The service's edge is the server's (``diloco.edge``): 12 connections that never send a
    byte, past the cap of 8 unproven per address, close their oldest; a caller with the token
    is served all the same, and its connection, once proven, is never the one closed."""
    service, runs = _service(max_connections=10, max_connections_per_address=8)
    idle: list[socket.socket] = []
    try:
        assert post(service, "forward", _body(SPEC, torch.randn(4, HIDDEN)), call="a", samples=4).ok
        for _ in range(12):
            idle.append(socket.create_connection(("127.0.0.1", service.port), timeout=5))
        # The table admits them on its event loop: a served request after them is the event.
        r = post(service, "forward", _body(SPEC, torch.randn(4, HIDDEN)), call="b", samples=4)
        assert r.ok
        table = service.connections
        assert table.closed_unproven >= 4  # 12 strangers over 8 per address (the rest: cap 10)
        assert table.open <= 10
        assert len(runs) == 2  # both token holders' forwards ran
    finally:
        for s in idle:
            s.close()
        service.stop()


def test_a_deferred_step_replies_first_and_callers_get_503_syncing_while_it_runs() -> None:
    """``defer_steps`` (stage sync): the backward that completes the step's samples is answered
    before the step runs; while the step runs (held open here, as a quorum round would hold
    it) a call is answered at once with 503 ``syncing`` and a ``retry_after``, and nothing of
    it ran; once the step is done the same call succeeds. An idle step (no driver) moves
    nothing and counts apart."""
    entered, release = threading.Event(), threading.Event()
    samples: list[int] = []

    def before_step(n: int) -> None:
        samples.append(n)
        if n:
            entered.set()
            assert release.wait(30)

    service, runs = _service(defer_steps=True, before_step=before_step)
    try:
        x = _body(SPEC, torch.randn(8, HIDDEN))
        assert post(service, "forward", x, call="a", samples=8).ok
        g = _body(OUT, torch.randn(8, HIDDEN))
        assert post(service, "backward", g, call="a").ok  # the reply, with the step held open
        assert entered.wait(10)
        busy = post(service, "forward", x, call="b", samples=8)
        assert busy.status_code == 503 and busy.json()["error"] == "syncing"
        assert 0 < busy.json()["retry_after"] <= 1.0
        assert len(runs) == 1 and service.stats()["busy"] == 1  # "b" never ran
        release.set()
        service.drain()
        assert post(service, "forward", x, call="b", samples=8).ok
        assert service.stats()["steps"] == 1 and samples == [8]
        before = copy.deepcopy(service.stage.state_dict())
        service.step_idle()  # a forward is held ("b"): its step is under way, no idle step
        assert service.stats()["idle_steps"] == 0
        assert post(service, "backward", g, call="b").ok
        service.drain()
        moved = copy.deepcopy(service.stage.state_dict())
        assert not torch.equal(before["weight"], moved["weight"])
        service.step_idle()
        assert service.stats()["idle_steps"] == 1 and samples == [8, 8, 0]
        assert all(torch.equal(moved[n], p) for n, p in service.stage.state_dict().items())
    finally:
        release.set()
        service.stop()
