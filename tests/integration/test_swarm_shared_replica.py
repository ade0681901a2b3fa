"""Several drivers feeding one body replica (issue 29): a step by one driver's micro-batches
between another driver's forward and its backward changes the replica's parameters under the
held forward. The replica then recomputes that forward from its kept input at the current
parameters before the backward, so the gradient is the one at the backward's time (Node0 and
SWARM take the same). Stage services on 127.0.0.1 port 0 in threads, two drivers with
``StaticRoutes``, the interleaving forced by a hook on driver A's tail."""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any

import pytest
import torch
from torch import nn

from diloco.swarm import Driver, Endpoint, StaticRoutes, SwarmPeer, split_sequential
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import TOKEN, Swarm, batches, loss_fn, make_model, make_optimizer, swarm
from tests.helpers.swarm_peers import BATCH, FAST, build_stage, make_peer

ROUNDS = 6
Batch = tuple[torch.Tensor, torch.Tensor]


class HeldLoss:
    """A hook for driver A's tail: each loss call stops before its work, says so (``arrived``)
    and waits until the test lets it ``go``, so driver B's whole step fits between driver A's
    forward on the shared body and its backward there."""

    def __init__(self) -> None:
        self.arrived: queue.Queue[str] = queue.Queue()
        self._go: queue.Queue[None] = queue.Queue()

    def __call__(self, kind: str, call: str) -> None:
        if kind == "loss":
            self.arrived.put(call)
            self._go.get(timeout=60)

    def go(self) -> None:
        self._go.put(None)


def _drivers(s: Swarm, heads: list[nn.Module]) -> list[Driver]:
    """Driver ``i`` sends stage 1 to the one body replica and stage 2 to tail ``i`` (a tail
    holds nothing between calls; two of them keep A's held loss from blocking B's). A failed
    backward would leave no replica: ``replica_wait_s`` short, so that fails fast."""
    body = Endpoint(s.services[1][0].address, TOKEN)
    return [
        Driver(
            head,
            make_optimizer(head),
            StaticRoutes({1: [body], 2: [Endpoint(s.services[2][i].address, TOKEN)]}),
            s.driver.boundaries,
            micro_batch=16,
            driver_id=f"driver-{i}",
            timeout_floor_s=10.0,
            replica_wait_s=1.0,
        )  # fmt: skip
        for i, head in enumerate(heads)
    ]


def _interleaved(a: Driver, b: Driver, held: HeldLoss, da: Batch, db: Batch) -> tuple[float, float]:
    """A's step with B's whole step between A's forward on the body and A's backward."""
    got: list[float] = []
    step = threading.Thread(target=lambda: got.append(a.train_step(*da)))
    step.start()
    held.arrived.get(timeout=30)  # A's forward is held by the body, at its parameters now
    loss_b = b.train_step(*db)  # the body steps on B's 16 samples
    held.go()
    step.join(30)
    assert not step.is_alive() and len(got) == 1, "driver A's step did not complete"
    return got[0], loss_b


def _reference(da: Batch, db: Batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """By hand: A's forward at the body's first parameters, B's step, then A's backward
    through the body's forward run again at the stepped parameters with the gradient A's tail
    returned for the first output. Returns the body's gradient of A's backward and head A's
    parameters after its step."""
    head_a, body, tail_a = (copy.deepcopy(m) for m in split_sequential(make_model(0), 3))
    head_b, tail_b = copy.deepcopy(head_a), copy.deepcopy(tail_a)
    body_opt = make_optimizer(body)

    def through(
        head: nn.Module, tail: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        h = head(x)
        h_in = h.detach().requires_grad_(True)
        o = body(h_in)
        o_in = o.detach().requires_grad_(True)
        loss_fn(tail(o_in), y).backward()
        return h, h_in, o, o_in.grad

    h_a, h_a_in, _, g_a = through(head_a, tail_a, *da)  # A's forward; its backward waits
    _, _, o_b, g_b = through(head_b, tail_b, *db)
    body_opt.zero_grad()  # A's forward made no body gradient; only B's backward counts
    torch.autograd.backward(o_b, g_b)
    body_opt.step()
    body_opt.zero_grad()
    h_a_again = h_a_in.detach().requires_grad_(True)
    torch.autograd.backward(body(h_a_again), g_a)  # the recompute, at the stepped parameters
    grads = {n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None}
    head_opt = make_optimizer(head_a)
    torch.autograd.backward(h_a, h_a_again.grad)
    head_opt.step()
    return grads, {n: p.detach().clone() for n, p in head_a.named_parameters()}


def test_a_step_between_a_forward_and_its_backward_recomputes_that_forward() -> None:
    """Driver B's whole step runs between driver A's forward on the shared body and A's
    backward: no 500, no reroute, no suspect, both steps complete, the body counts one
    recompute, and the gradient the body steps on for A's backward, and head A's parameters
    after its step, equal the ones computed by hand at the stepped parameters."""
    (da,), (db,) = batches(1, 16, seed=1), batches(1, 16, seed=2)
    want_grads, want_head = _reference(da, db)
    held = HeldLoss()
    seen: list[dict[str, torch.Tensor]] = []
    with swarm(replicas={2: 2}, hooks={(2, 0): held}) as s:
        body = s.services[1][0]
        body.gate.before_step = lambda samples: seen.append(
            {n: p.grad.clone() for n, p in body.stage.named_parameters() if p.grad is not None}
        )
        heads = [copy.deepcopy(s.stages[0]) for _ in range(2)]
        a, b = _drivers(s, heads)
        try:
            _interleaved(a, b, held, da, db)
            for d in (a, b):
                assert d.stats()["reroutes"] == 0 and d.routes.suspects == {}  # type: ignore[attr-defined]
            stats = body.stats()
            assert stats["recomputes"] == 1 and stats["steps"] == 2 and stats["refused"] == 0
            assert len(seen) == 2 and set(seen[1]) == set(want_grads)
            for name, grad in want_grads.items():
                assert torch.equal(seen[1][name], grad), name
            for name, p in heads[0].named_parameters():
                assert torch.equal(p.detach(), want_head[name]), name
        finally:
            a.close()
            b.close()


def test_two_drivers_sharing_a_body_replica_train_through_interleaved_steps() -> None:
    """Every one of ``ROUNDS`` rounds puts B's step between A's forward and A's backward on the
    one body replica: every step of both drivers completes with no reroute, the body recomputes
    once per round and steps once per driver step, and both drivers' losses fall (each repeats
    its own batch)."""
    (da,), (db,) = batches(1, 16, seed=1), batches(1, 16, seed=2)
    held = HeldLoss()
    with swarm(replicas={2: 2}, hooks={(2, 0): held}) as s:
        a, b = _drivers(s, [copy.deepcopy(s.stages[0]) for _ in range(2)])
        try:
            losses = [_interleaved(a, b, held, da, db) for _ in range(ROUNDS)]
            stats = s.services[1][0].stats()
            assert stats["recomputes"] == ROUNDS and stats["steps"] == 2 * ROUNDS
            assert a.stats()["reroutes"] == b.stats()["reroutes"] == 0
            for d in (0, 1):
                curve = [pair[d] for pair in losses]
                assert curve[-1] < curve[0] - 0.1, curve
        finally:
            a.close()
            b.close()


def test_one_driver_never_recomputes() -> None:
    """One driver, micro-batches in flight: every backward meets its forward's parameters (a
    replica steps only once a driver's step is in), so nothing is recomputed."""
    with swarm(micro_batch=4, max_in_flight=4) as s:
        for x, y in batches(3, 16):
            s.driver.train_step(x, y)
        assert [g[0].stats()["recomputes"] for g in s.services.values()] == [0, 0]


@pytest.mark.timeout(120)
def test_a_stage_round_between_a_forward_and_its_backward_is_recomputed_over(
    make_server: ServerFactory,
) -> None:
    """Peers through a real ``--swarm`` coordinator, no pinning: two heads share the one body
    replica, which syncs every step (a round of one: the outer step's result adopted in place).
    Head B's whole step, the body's step and round included, runs between head A's forward on
    the body and A's backward there: A's step completes with no reroute, the body recomputes
    once, and the gradient it steps on equals the one computed by hand at the parameters the
    round left; the body's heartbeat brings the count to the coordinator's status."""
    server = make_server(
        swarm=True, stages=3, min_replicas=1, token="peer-token", **{**FAST, "join_timeout": 30.0}
    )
    (da,), (db,) = batches(1, BATCH, seed=1), batches(1, BATCH, seed=2)
    started: list[SwarmPeer] = []
    try:
        for k, options in ((1, {"sync_every": 1, "idle_step_s": 600.0}), (2, {}), (0, {}), (0, {})):
            started.append(make_peer(server, k, **options).start())
        body, _, head_a, head_b = started
        assert body.service is not None and body.worker is not None
        assert head_a.driver is not None and head_b.driver is not None
        seen: list[dict[str, torch.Tensor]] = []
        stage = body.service.stage
        before = body.service.gate.before_step

        def capture(samples: int) -> None:
            seen.append(
                {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
            )
            if before is not None:
                before(samples)

        body.service.gate.before_step = capture
        arrived, go = threading.Event(), threading.Event()
        backward = head_a.driver._backward

        def held_backward(step: Any, k: int, record: Any, ep: Any) -> torch.Tensor:
            if k == 1 and not arrived.is_set():
                arrived.set()  # A's forward is held by the body, at its first parameters
                assert go.wait(60), "the test never let A's backward go"
            return backward(step, k, record, ep)

        head_a.driver._backward = held_backward  # type: ignore[method-assign]
        got: list[float] = []
        step = threading.Thread(target=lambda: got.append(head_a.train_step(*da)))
        step.start()
        assert arrived.wait(30)
        head_b.train_step(*db)
        body.service.drain()  # the body's step and its round, deferred past B's reply, done
        assert body.worker.sync_metrics["rounds"] == 1
        stepped = {n: p.detach().clone() for n, p in stage.named_parameters()}
        go.set()
        step.join(30)
        assert not step.is_alive() and len(got) == 1
        body.service.drain()
        assert body.service.stats()["recomputes"] == 1
        body.beat()  # the peer's heartbeat carries it; the status sums the live replicas'
        assert server.status()["swarm"]["recomputes"] == 1
        assert head_a.stats()["reroutes"] == head_b.stats()["reroutes"] == 0
        assert body.worker.sync_metrics["rounds"] == 2 and len(seen) == 2
        want = _by_hand_at(stepped, da)
        assert set(seen[1]) == set(want)
        for name, grad in want.items():
            assert torch.equal(seen[1][name], grad), name
    finally:
        for p in started:
            p.stop()


def _by_hand_at(stepped: dict[str, torch.Tensor], da: Batch) -> dict[str, torch.Tensor]:
    """The body's gradient of A's backward: the output gradient A's (fresh) tail returned for
    the body's first output, backed up through the body's forward at ``stepped``."""
    head, body, tail = (build_stage(k, 3) for k in range(3))
    h = head(da[0]).detach()
    out = body(h).detach().requires_grad_(True)
    loss_fn(tail(out), da[1]).backward()
    with torch.no_grad():
        for name, p in body.named_parameters():
            p.copy_(stepped[name])
    torch.autograd.backward(body(h.clone().requires_grad_(True)), out.grad)
    return {n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None}
