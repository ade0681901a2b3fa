"""All-reduce mode under a fault (issue 19): a worker killed with SIGKILL inside the averaging
all-reduce. The survivors' collective fails at once, the round is discarded (nobody applies a
partial average), and once the dead worker has been silent for two of its heartbeat intervals
(long before its heartbeat timeout evicts it) a quorum of the survivors repeats the round with
the pseudo-gradients they still hold: they end exactly where two workers that never met the
third end."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.allreduce import quorum_sync
from diloco.worker.allreduce.collective import QuorumCollective, QuorumFailed
from tests.helpers.allreduce import ROUNDS, run_workers


@pytest.mark.timeout(120)
def test_a_restarted_server_loses_nothing_the_workers_hold_the_state() -> None:
    """The server is stopped right after round 2 and a new one started on the same port: the
    workers re-register, present the state they hold, and go on from round 2 together (every
    round both reach, they reach with the same bytes): the new server's first quorum waits for
    both (its heartbeat timeout's grace) rather than letting the first one back go on alone."""
    srv = DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)).start()
    port = srv.port
    servers = [srv]
    restarted = threading.Event()
    states: dict[int, dict[int, dict[str, torch.Tensor]]] = {0: {}, 1: {}}

    def after_sync(rank: int, r: int, w: DiLoCoWorker) -> None:
        params = {k: v.detach().clone() for k, v in w._local.params.items()}
        states[rank][w.base_round] = params
        if rank == 0 and w.base_round == 2 and not restarted.is_set():
            servers[-1].stop()
            servers.append(
                DiLoCoServer(ServerConfig(port=port, num_workers=2, allreduce=True)).start()
            )
            restarted.set()

    try:
        results = run_workers(srv.address, 2, 6, after_sync=after_sync)
        status = servers[-1].status()
    finally:
        for s in servers:
            s.stop()
    assert restarted.is_set() and len(servers) == 2
    (_, ma), (_, mb) = results
    assert ma["reconnections"] >= 1 and mb["reconnections"] >= 1
    common = sorted(set(states[0]) & set(states[1]))
    after = [r for r in common if r > 2]
    assert after, (sorted(states[0]), sorted(states[1]))
    for r in common:
        for k in states[0][r]:
            assert torch.equal(states[0][r][k], states[1][r][k]), (r, k)
    # The new server counts on from the workers' state, not from 0.
    assert status["round"] >= max(after)


@pytest.mark.timeout(120)
def test_a_commit_point_that_fails_on_one_member_after_the_others_passed_counts_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two generals: the commit point's collective completes everywhere, but rank 2 (w2)
    takes it for failed (its group breaks right after) while the others apply the round. w2
    reports the failure and asks again; its next quorum hands it the state the others made,
    naming the quorum that made it, which is the one w2 contributed to: w2 takes that state
    instead of keeping its (already counted) progress on top, so it adds nothing (weight 0) to
    the next average, where a rebase would add its pseudo-gradient a second time."""
    original = QuorumCollective.collective
    original_average = quorum_sync.checked_average
    checks: list[int] = []
    weights_after: list[float] = []  # w2's weights in the averages after the fault

    def collective(self: QuorumCollective, what: str, start: Any) -> None:
        original(self, what, start)
        if what == "hash check" and self.rank == 2:
            checks.append(1)
            if len(checks) == 3:  # the join, round 0, then round 1's commit point
                self.close()
                raise QuorumFailed(self.quorum_id, "hash check failed: injected")

    def average(group: QuorumCollective, tensors: Any, weight: float, *a: Any, **k: Any) -> Any:
        if group.rank == 2 and len(checks) >= 3:
            weights_after.append(weight)
        return original_average(group, tensors, weight, *a, **k)

    monkeypatch.setattr(QuorumCollective, "collective", collective)
    monkeypatch.setattr(quorum_sync, "checked_average", average)
    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results = run_workers(srv.address, 3, ROUNDS)
        status = srv.status()
    assert len(checks) >= 3 and status["rounds_discarded"] == 1
    w2 = results[2][1]
    assert w2["rebases"] == 1 and w2["dropped_steps"] == 0
    assert weights_after and weights_after[0] == 0.0


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Poll the server's state until ``condition()`` holds (the event is the server's)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_a_server_restarted_while_a_worker_waits_to_join_is_registered_with_again() -> None:
    """w0 registered and waits in its joining quorum's long poll when the server restarts: the
    new server answers 410 unknown_worker; w0 registers again and joins once w1 comes, instead
    of failing its start (found by the streaming chaos run)."""
    srv = DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)).start()
    servers = [srv]
    errors: list[BaseException] = []
    joined: list[str] = []

    def join(worker_id: str, address: str) -> None:
        try:
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with DiLoCoWorker(
                model, opt, address, sync_every=2, heartbeat_interval=0.2, worker_id=worker_id
            ) as w:
                joined.append(worker_id)
                assert w.sync_metrics["reconnections"] >= (worker_id == "w0")
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    first = threading.Thread(target=join, args=("w0", srv.address))
    second: threading.Thread | None = None
    try:
        first.start()
        wait_for(lambda: "w0" in srv.status()["pending_quorum"], "w0 to wait for its quorum")
        srv.stop()
        new = DiLoCoServer(ServerConfig(port=srv.port, num_workers=2, allreduce=True)).start()
        servers.append(new)
        registered = lambda: any(w["worker_id"] == "w0" for w in new.status()["workers"])  # noqa: E731
        wait_for(registered, "w0 to register with the new server")
        second = threading.Thread(target=join, args=("w1", new.address))
        second.start()
        second.join(30)
        first.join(30)
    finally:
        for s in servers:
            s.stop()
    assert not errors, errors
    assert sorted(joined) == ["w0", "w1"]
