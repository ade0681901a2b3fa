"""All-reduce mode against one faulty worker (issue 26, items 2, 3 and 5): a weight out of
bounds refused at the route, a member claiming a state the run never agreed on, a member whose
joins always fail while it heartbeats, a member that dies between its commit point and its
report. A real server on loopback and real workers (threads, gloo)."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.server.allreduce.suspects import MARGIN_S
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.collective import QuorumFailed
from diloco.worker.allreduce.quorum_sync import QuorumSync
from tests.helpers.allreduce import EVERY, ROUNDS, make_model, run_workers
from tests.helpers.http import assert_error, post_json, post_raw
from tests.helpers.threads import in_threads

TABLE = [["b", [4]], ["w", [3, 4]]]
AGREEMENT = "diloco.server.allreduce.agreement"
SUSPECTS = "diloco.server.allreduce.suspects"
Results = list[tuple[dict[str, torch.Tensor], dict[str, float]]]


def assert_identical(results: Results) -> None:
    """Every worker ended with the same parameters, bit for bit."""
    first = results[0][0]
    for params, _ in results[1:]:
        for name, t in first.items():
            assert torch.equal(params[name], t), name


def messages(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


@pytest.mark.timeout(60)
def test_a_weight_out_of_bounds_is_refused_at_the_route_and_changes_nothing() -> None:
    """1e300, -1, NaN and infinities (as JSON can carry them): 400 ``bad_field`` naming
    ``weight``, nothing filed; the largest weight allowed (1e12) is filed."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True, poll_timeout=0.5)
    with DiLoCoServer(config) as srv:
        reply = post_json(srv, "/register", {"worker_id": "w0", "info": {"params": TABLE}})
        assert reply.status_code == 200, reply.text
        for raw in ("1e300", "-1", "NaN", "Infinity", "-Infinity"):
            body = f'{{"worker_id": "w0", "round": 0, "hash": "h0", "weight": {raw}}}'
            resp = post_raw(srv, "/quorum", body.encode(), {"Content-Type": "application/json"})
            assert "weight" in assert_error(resp, 400, "bad_field")["detail"], raw
            status = srv.status()
            assert status["pending_quorum"] == [] and status["quorum"] is None
        ok = {"worker_id": "w0", "round": 0, "hash": "h0", "weight": 1e12}
        assert post_json(srv, "/quorum", ok).status_code == 202  # filed; w1 never comes


@pytest.mark.timeout(120)
def test_a_member_claiming_a_state_the_run_never_agreed_on_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After round 2, w2 claims round 1002 with a hash of its own. The server refuses it
    (409 ``unagreed_state``) instead of making it the source; w2 asks again presenting no state,
    receives the run's with its progress on top, and the run goes on: every replica ends
    bit-identical, at the round a run without the fault ends at, close to that run's state (w2's
    progress went through a rebase: a rounding apart)."""

    def claim(rank: int, _: int, w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        if rank == 2 and w.base_round == 2 and not claimed.is_set():
            claimed.set()
            strategy._s.base_round += 1000
            strategy._hash = "f00d" * 4  # a state of its own

    claimed = threading.Event()
    config = ServerConfig(port=0, num_workers=3, allreduce=True)
    rounds = ROUNDS + 1
    with DiLoCoServer(config) as srv:
        reference = run_workers(srv.address, 3, rounds)
    with caplog.at_level(logging.WARNING, logger=AGREEMENT), DiLoCoServer(config) as srv:
        results = run_workers(srv.address, 3, rounds, after_sync=claim)
        status = srv.status()
    assert claimed.is_set()
    assert messages(caplog, r"worker w2 presented a state the run never agreed on \(round 1002")
    assert status["round"] == rounds and status["rounds_discarded"] == 0
    assert results[2][1]["rebases"] == 1
    assert_identical(results)
    for name, t in reference[0][0].items():
        torch.testing.assert_close(results[0][0][name], t)


@pytest.mark.timeout(120)
def test_a_member_whose_joins_always_fail_is_left_out_and_the_others_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """w2 comes once w0 and w1 have completed a round, and heartbeats, but every quorum it is in
    fails at its join (its gloo port firewalled: its connect raises; the others' connects time
    out). After two such quorums in a row the member that never completed one, w2, is left
    out: w0 and w1 complete every later round, w2 trains alone (its syncs answered 409
    ``left_out`` at once, the warning logged once) and, once its leave ran out (w2 waits for
    the server to list it no more), is tried again in a quorum. (The doubled leave after it
    fails again: tests/unit/test_quorum.py.)"""
    original = QuorumSync._round
    tries: list[tuple[str, tuple[str, ...]]] = []

    def round_(self: QuorumSync, q: Assignment, weighted: bool) -> tuple[int, str]:
        if self._s.worker_id == "w2":
            tries.append((q.quorum_id, q.members))
            raise QuorumFailed(q.quorum_id, "injected: its gloo port is firewalled")
        return original(self, q, weighted)

    monkeypatch.setattr(QuorumSync, "_round", round_)
    first_round = threading.Event()
    config = ServerConfig(
        port=0, num_workers=2, allreduce=True, collective_timeout=0.5, join_timeout=1.0
    )
    rounds = 6

    def run(rank: int) -> dict[str, float]:
        if rank == 2:
            assert first_round.wait(60)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        with DiLoCoWorker(
            model, opt, srv.address, sync_every=EVERY, heartbeat_interval=0.2, worker_id=f"w{rank}"
        ) as w:
            for _ in range(rounds * EVERY):
                if rank == 2 and w.sync_metrics["failed_syncs"] and not retried():
                    wait_for_leave_to_end()  # an event of the server's, not a sleep
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
                w.report()
                if w.base_round >= 1:
                    first_round.set()
            return dict(w.sync_metrics)

    def retried() -> bool:
        return 0 <= tries_at_leave[0] < len(tries)

    def wait_for_leave_to_end() -> None:
        if tries_at_leave[0] < 0:
            tries_at_leave[0] = len(tries)
        deadline = time.monotonic() + 30
        while any(x["worker_id"] == "w2" for x in srv.status()["left_out"]):
            assert time.monotonic() < deadline, "w2's leave never ran out"
            time.sleep(0.05)

    tries_at_leave = [-1]
    with caplog.at_level(logging.INFO), DiLoCoServer(config) as srv:
        m0, m1, m2 = in_threads(3, run)
        status = srv.status()
    left = messages(caplog, r"worker w2 left out of quorums")
    assert left and "never completed one" in left[0] and "after 1 s" in left[0], left
    assert not messages(caplog, r"worker w[01] left out")
    assert m0["rounds"] == m1["rounds"] == rounds and status["rounds_completed"] == rounds
    assert m2["rounds"] == 0 and m2["failed_syncs"] >= 1
    assert len(messages(caplog, r"worker w2: worker 'w2' is left out")) <= len(left)  # once each
    assert 0 <= tries_at_leave[0] < len(tries), tries  # a quorum with w2 after its leave


@pytest.mark.timeout(90)
def test_a_member_dead_between_its_commit_point_and_its_report_holds_nobody(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """w2 passes round 2's commit point, applies the step and then stops: no report, no
    heartbeat. The quorum completes with w0's and w1's reports once w2 has been silent two
    heartbeat intervals plus the margin (0.9 s here), far from the heartbeat timeout (60 s) or
    the quorum's deadline (120 s); the survivors go on without it."""
    original = QuorumSync._report
    workers: dict[int, DiLoCoWorker] = {}
    dead, survivors_done = threading.Event(), threading.Event()

    def report(self: QuorumSync, q: Assignment, **outcome: Any) -> None:
        if self._s.worker_id == "w2" and outcome.get("ok") and q.round == 2:
            dead.set()
            workers[2]._heartbeats.stop()
            survivors_done.wait(60)  # back only once the others are done: never heard
            return
        original(self, q, **outcome)

    def note(rank: int, _: int, w: DiLoCoWorker) -> None:
        workers[rank] = w
        if rank != 2 and w.base_round == ROUNDS + 2:
            done.append(rank)
            if len(done) == 2:
                survivors_done.set()

    done: list[int] = []
    monkeypatch.setattr(QuorumSync, "_report", report)
    config = ServerConfig(port=0, num_workers=3, allreduce=True, heartbeat_timeout=60.0)
    with caplog.at_level(logging.WARNING, logger=SUSPECTS), DiLoCoServer(config) as srv:
        results = run_workers(srv.address, 3, ROUNDS + 2, after_sync=note)
        status = srv.status()
    assert dead.is_set() and survivors_done.is_set()
    (waited,) = messages(caplog, r"w2 silent since the first report")
    took = float(re.search(r"report ([0-9.]+) s ago", waited).group(1))  # type: ignore[union-attr]
    interval = 0.2  # run_workers' heartbeat interval
    assert took <= 2 * interval + MARGIN_S + interval + 0.5, waited  # + a heartbeat, a tick
    assert status["rounds_discarded"] == 0
    assert_identical(results[:2])
