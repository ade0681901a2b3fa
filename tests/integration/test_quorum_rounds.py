"""Quorum rounds with real workers over HTTP (``--quorum 2 --grace 0``, three workers): a round
closes on its quorum while a third worker's upload body is mid-transfer (held by a hook in its
``produce`` until the close happened); that upload is merged into the next round with the
staleness weight 1/sqrt(2), counted once, the worker adopts the round that holds it without
rebasing, and every replica equals what the server serves. A frozen worker does not hold the
others: they go on closing rounds without it.

Outer SGD with lr 1 and no momentum, so a round's result is the base minus the weighted mean
of its pseudo-gradients; each worker's inner step is ``+delta`` (tests/helpers/workers.py)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.cli.status import render_status
from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.faultproxy import Fault, FaultProxy
from tests.helpers.http import TIMEOUT, status, wait_round
from tests.helpers.servers import ServerFactory, published
from tests.helpers.workers import fake_step, make_model, params_of

W = 1 / math.sqrt(2)  # the weight of an upload one round late
RETRIES = 3
CONTINUE = len(b"HTTP/1.1 100 Continue\r\n\r\n")


def worker(server: DiLoCoServer, seed: int) -> tuple[DiLoCoWorker, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    w = DiLoCoWorker(model, opt, server.address, sync_every=1, heartbeat_interval=0)
    return w.start(), opt


def hold_second_tensor(w: DiLoCoWorker, holding: threading.Event, release: threading.Event) -> None:
    """The worker's next upload sends its header and first tensor, then waits for ``release``
    before producing the second: its body is mid-transfer on the server meanwhile."""
    submit = w.client.submit_pseudogradients

    def held(*args: Any, **kwargs: Any) -> dict[str, Any]:
        specs, produce = args[3], args[4]

        def slow(spec: Any) -> torch.Tensor | Iterable[torch.Tensor]:
            if spec is specs[1]:
                holding.set()
                assert release.wait(TIMEOUT)
            return produce(spec)

        return submit(*args[:4], slow, *args[5:], **kwargs)

    w.client.submit_pseudogradients = held  # type: ignore[method-assign]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def run(target: Callable[[], None]) -> threading.Thread:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:  # surfaced by join_all
            errors.append(exc)
            raise

    t = threading.Thread(target=body, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


def join_all(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a worker thread hung"
        assert not t.errors, t.errors  # type: ignore[attr-defined]


def test_a_round_closing_mid_upload_merges_it_into_the_next_round_exactly_once(
    make_server: ServerFactory,
) -> None:
    p0 = params_of(make_model(0))
    server = make_server(
        params=p0,
        num_workers=3,
        quorum="2",
        grace="0",
        upload_slots=2,
        outer_momentum=0.0,
        outer_lr=1.0,
    )
    (a, opt_a), (b, opt_b), (c, opt_c) = (worker(server, s) for s in (1, 2, 3))
    holding, release = threading.Event(), threading.Event()
    hold_second_tensor(c, holding, release)
    try:
        tc = run(lambda: fake_step(c.model, opt_c, 5.0))  # uploads -5, held mid-body
        assert holding.wait(TIMEOUT)
        wait_until(lambda: status(server)["uploading"] == [c.worker_id], "c's upload began")
        ta = run(lambda: fake_step(a.model, opt_a, 1.0))
        tb = run(lambda: fake_step(b.model, opt_b, 3.0))
        join_all(ta, tb)  # round 0 closed on a and b: p0 + 2
        assert status(server)["round"] == 1 and status(server)["uploading"] == [c.worker_id]
        release.set()
        wait_until(lambda: status(server)["submitted"] == [c.worker_id], "c merged into round 1")
        ta = run(lambda: fake_step(a.model, opt_a, 1.0))  # a's -1 completes round 1's quorum
        join_all(ta, tc)
        wait_round(server, 2)
        round_, served = published(server.address)
        assert round_ == 2
        expected = 2.0 + (5.0 * W + 1.0) / (W + 1.0)  # each upload's steps counted once
        for name, p in p0.items():
            torch.testing.assert_close(served[name], p + expected)
            torch.testing.assert_close(params_of(a.model)[name], served[name])  # replicas agree
            torch.testing.assert_close(params_of(c.model)[name], served[name])
            torch.testing.assert_close(params_of(b.model)[name], p + 2.0)  # still at round 1
        mc = c.sync_metrics
        assert (mc["late_merges"], mc["dropped_steps"], mc["rebases"]) == (1, 0, 0)
        assert mc["refused_submissions"] == 0
        assert c.base_round == 2
        st = status(server)
        assert [m["worker_id"] for m in st["quorum_rounds"]["late_merges"]] == [c.worker_id]
        assert st["update_log"][-1]["contributions"] == 2
        assert ", late merges 1" in render_status(Status.from_json(st))  # diloco status
    finally:
        release.set()
        for w in (a, b, c):
            w.stop(submit=False)


@pytest.mark.parametrize("grace", ["0", "auto"])
def test_a_frozen_worker_does_not_set_the_pace(make_server: ServerFactory, grace: str) -> None:
    """c registered (it is expected in every round) but never syncs, as a worker frozen in its
    loop: a and b close rounds 0 to 3 without it. With ``auto`` (floor 0) the window is
    derived from a and b alone."""
    p0 = params_of(make_model(0))
    extra = {"grace_floor": 0.0, "grace_ceiling": 5.0} if grace == "auto" else {}
    server = make_server(
        params=p0,
        num_workers=3,
        quorum="2",
        grace=grace,
        outer_momentum=0.0,
        outer_lr=1.0,
        **extra,
    )
    workers = [worker(server, s) for s in (1, 2, 3)]
    try:
        for r in range(4):
            threads = [run(lambda w=w, o=o: fake_step(w.model, o, 1.0)) for w, o in workers[:2]]
            join_all(*threads)
            assert status(server)["round"] == r + 1
        st = status(server)
        assert st["quorum_rounds"]["size"] == 2 and st["quorum_rounds"]["late_merges"] == []
        assert [e["contributions"] for e in st["update_log"]] == [2, 2, 2, 2]
    finally:
        for w, _ in workers:
            w.stop(submit=False)


def test_a_late_upload_whose_answers_were_lost_counts_once_when_sent_again(
    make_server: ServerFactory,
) -> None:
    """c uploads after round 0 closed without it: merged late into round 1, but every answer is
    cut (c's link goes through a proxy), so c cannot know. Its next sync sends the same id, is
    told ``duplicate`` in round 1, drops the one step taken since (``dropped_steps``) rather than
    counting its first step twice, and adopts round 2 like the others."""
    p0 = params_of(make_model(0))
    server = make_server(
        params=p0, num_workers=3, quorum="2", grace="0", outer_momentum=0.0, outer_lr=1.0
    )
    proxy = FaultProxy(server.port)
    (a, opt_a), (b, opt_b) = (worker(server, s) for s in (1, 2))
    model_c = make_model(3)
    opt_c = torch.optim.SGD(model_c.parameters(), lr=1.0)
    client = DiLoCoClient(proxy.address, retries=RETRIES, backoff=0.01, read_timeout=10)
    c = DiLoCoWorker(
        model_c, opt_c, proxy.address, sync_every=1, heartbeat_interval=0, client=client
    ).start()
    try:
        join_all(
            run(lambda: fake_step(a.model, opt_a, 1.0)), run(lambda: fake_step(b.model, opt_b, 3.0))
        )  # round 0 closed on a and b: p0 + 2
        for _ in range(1 + RETRIES):
            proxy.add(Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd"))
        fake_step(model_c, opt_c, 5.0)  # counted late in round 1; every answer lost
        assert c.sync_metrics["failed_syncs"] == 1
        assert status(server)["submitted"] == [c.worker_id]
        tc = run(lambda: fake_step(model_c, opt_c, 5.0))  # same id again: duplicate
        wait_until(lambda: c.sync_metrics["dropped_steps"] == 1, "c learned it was counted")
        join_all(run(lambda: fake_step(a.model, opt_a, 1.0)), tc)  # round 1: c's late + a's
        round_, served = published(server.address)
        assert round_ == 2
        expected = 2.0 + (5.0 * W + 1.0) / (W + 1.0)  # c's first step once, its second dropped
        for name, p in p0.items():
            torch.testing.assert_close(served[name], p + expected)
            torch.testing.assert_close(params_of(model_c)[name], served[name])
        assert c.sync_metrics["rebases"] == 0
    finally:
        for w in (a, b, c):
            w.stop(submit=False)
        proxy.close()
