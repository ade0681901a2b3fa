"""All-reduce mode's checks (issue 26, worker/allreduce/average_checks.py): no faulty member's
contribution reaches any replica. Workers in threads of this process with real gloo groups, a
real server with ``allreduce=True`` on loopback; the fault is injected by a hook in one worker's
training loop at a chosen step.

- A member whose model goes NaN (or +1e30, with two members: the lower median) is left out of
  that round: every replica, its own included, holds the agreed state after it, all finite and
  bit-identical; it is named in every member's outcome and in the server's /status, and its
  steps are counted as dropped.
- A member that states a small norm but sends a huge tensor: the average fails its check on
  every member, the round is discarded everywhere (no replica took it); told the truth, it is
  left out by its norm.
- A weight of 1e300 (a member past the client's bounds): left out by its weight.
- A diverged worker's non-finite loss is not sent with its heartbeats (the server would refuse
  them, and it must stay a member for the checks to act)."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.wire.messages.uploads import MAX_WEIGHT
from diloco.worker.allreduce import average_checks
from diloco.worker.allreduce.collective import QuorumCollective
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.allreduce import EVERY, run_faulty

FAULT_STEP = 12  # inside the third round of EVERY (6) steps: rounds 0 and 1 are clean
ROUNDS = 4
HELD = dict[int, dict[int, tuple[str, dict[str, torch.Tensor]]]]


class Outcomes:
    """Every ``POST /quorum/outcome`` the workers send, as the client was asked to send it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        original = DiLoCoClient.quorum_outcome

        def record(client: DiLoCoClient, worker_id: str, quorum_id: str, **kw: Any) -> Any:
            with self._lock:
                self.sent.append({"worker_id": worker_id, "quorum_id": quorum_id, **kw})
            return original(client, worker_id, quorum_id, **kw)

        monkeypatch.setattr(DiLoCoClient, "quorum_outcome", record)

    def naming(self, worker: str) -> list[dict[str, Any]]:
        return [o for o in self.sent if worker in o.get("excluded", ())]


def poison(rank_: int, value: float) -> Any:
    """A hook that fills worker ``rank_``'s parameters with ``value`` before step FAULT_STEP,
    and from then on reports its loss as NaN (a diverged model's)."""

    def fault(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank != rank_ or step < FAULT_STEP:
            return
        if step == FAULT_STEP:
            with torch.no_grad():
                for p in w._local.params.values():
                    p.fill_(value)
        w.report(loss=math.nan)

    return fault


def assert_replicas_agree(held: HELD, n: int, *, models: bool = True) -> None:
    """Every round every worker reached, every worker reached it with the same state (and,
    unless streaming, where each keeps its progress on the other fragments, the same model),
    every model finite and small."""
    common = set.intersection(*(set(held[r]) for r in range(n)))
    assert len(common) >= ROUNDS, {r: sorted(held[r]) for r in range(n)}
    for r in common:
        hash0, params0 = held[0][r]
        for rank in range(n):
            got_hash, params = held[rank][r]
            assert got_hash == hash0, (r, rank)
            # Finite, and of an honest model's size (+1e30 or +1000 never reached it).
            assert all(float(t.abs().max()) < 10 for t in params.values()), (r, rank)
            for k in params0:
                assert not models or torch.equal(params[k], params0[k]), (r, rank, k)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("value", "n"), [(math.nan, 3), (1e30, 2)], ids=["nan-of-3", "1e30-of-2"])
def test_a_member_whose_model_breaks_is_left_out_and_every_replica_stays_sound(
    monkeypatch: pytest.MonkeyPatch, value: float, n: int
) -> None:
    outcomes = Outcomes(monkeypatch)
    bad = f"w{n - 1}"
    with DiLoCoServer(ServerConfig(port=0, num_workers=n, allreduce=True)) as srv:
        results, held = run_faulty(srv.address, n, ROUNDS, poison(n - 1, value))
        status = srv.status()
    assert_replicas_agree(held, n)
    for rank, r in enumerate(results):
        m = r["metrics"]
        assert m["rounds"] == ROUNDS and m["discarded_rounds"] == 0, (rank, m)
        assert m["excluded_rounds"] == (rank == n - 1)
        # Left out once: the round's 6 steps of its progress are dropped, the model took the
        # agreed state and trained soundly again.
        assert m["dropped_steps"] == (EVERY if rank == n - 1 else 0)
        assert all(bool(torch.isfinite(t).all()) for t in r["params"].values())
    # Every member's outcome of that quorum names it (and only that quorum's).
    named = outcomes.naming(bad)
    assert len(named) == n and len({o["quorum_id"] for o in named}) == 1
    assert all(o["ok"] and o["excluded"] == (bad,) for o in named)
    assert status["excluded_last"] == [bad]
    assert status["excluded_rounds"] == [{"worker_id": bad, "rounds": 1, "in_a_row": 0}]
    assert status["rounds_discarded"] == 0


@pytest.mark.timeout(120)
def test_a_member_that_understates_its_norm_gets_the_round_discarded_on_every_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """w2's model jumps by +1000 (a huge but finite pseudo-gradient) and, once, it states a
    norm like the others': the average is far above what the stated norms allow, every member's
    check fails and the round is discarded on all three (reported at stage "check"); no replica
    took a step from it. Its next quorum it states the truth and is left out by its norm."""
    outcomes = Outcomes(monkeypatch)
    original = average_checks.measure
    broken = threading.Event()
    lied: list[float] = []

    def fault(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank == 2 and step == FAULT_STEP:
            with torch.no_grad():
                for p in w._local.params.values():
                    p.add_(1000.0)
            broken.set()

    def measure(quorum: QuorumCollective, flats: Any) -> tuple[bool, float]:
        finite, norm = original(quorum, flats)
        if quorum.rank == 2 and broken.is_set() and not lied:
            lied.append(norm)
            return True, 1.0
        return finite, norm

    monkeypatch.setattr(average_checks, "measure", measure)
    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results, held = run_faulty(srv.address, 3, ROUNDS, fault)
        status = srv.status()
    assert lied and lied[0] > 1e4  # the tensor it sent
    failed = [o for o in outcomes.sent if not o["ok"]]
    assert len(failed) == 3 and len({o["quorum_id"] for o in failed}) == 1
    assert all(o["stage"] == "check" and "failed its check" in o["error"] for o in failed)
    assert status["rounds_discarded"] == 1
    assert_replicas_agree(held, 3)
    assert [r["metrics"]["excluded_rounds"] for r in results] == [0, 0, 1]
    assert [r["metrics"]["discarded_rounds"] for r in results] == [1, 1, 1]
    assert status["excluded_rounds"] == [{"worker_id": "w2", "rounds": 1, "in_a_row": 0}]


@pytest.mark.timeout(120)
def test_a_weight_of_1e300_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--weighting samples``; w1 reports 1e300 samples once. Its quorum ask would tell the
    server that weight (refused there); this member goes past that check (it leaves the weight
    out of its ask), so the quorum's own check must leave it out."""
    outcomes = Outcomes(monkeypatch)
    original = DiLoCoClient.quorum

    def quorum(client: DiLoCoClient, worker_id: str, **kw: Any) -> Any:
        if (kw.get("weight") or 0) > MAX_WEIGHT:
            kw["weight"] = None
        return original(client, worker_id, **kw)

    monkeypatch.setattr(DiLoCoClient, "quorum", quorum)

    def fault(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank == 1 and step == FAULT_STEP:
            w.report(samples=1e300)

    config = ServerConfig(port=0, num_workers=3, allreduce=True, weighting="samples")
    with DiLoCoServer(config) as srv:
        results, held = run_faulty(srv.address, 3, ROUNDS, fault)
        status = srv.status()
    assert_replicas_agree(held, 3)
    named = outcomes.naming("w1")
    assert len(named) == 3 and all(o["excluded"] == ("w1",) for o in named)
    assert [r["metrics"]["excluded_rounds"] for r in results] == [0, 1, 0]
    assert status["excluded_rounds"] == [{"worker_id": "w1", "rounds": 1, "in_a_row": 0}]


@pytest.mark.timeout(120)
def test_a_streaming_member_that_goes_nan_is_left_out_and_takes_the_whole_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two fragments, rounds on the training thread: w2's NaN model is left out of the round
    of its next fragment, and its whole model (both fragments) takes the agreed state, so the
    next fragment's round admits it again."""
    outcomes = Outcomes(monkeypatch)
    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results, held = run_faulty(
            srv.address, 3, ROUNDS, poison(2, math.nan), num_fragments=2, overlap_steps=0
        )
    assert_replicas_agree(held, 3, models=False)
    assert len(outcomes.naming("w2")) == 3
    m = results[2]["metrics"]
    assert m["excluded_rounds"] == 1 and m["dropped_steps"] > 0
    assert all(bool(torch.isfinite(t).all()) for r in results for t in r["params"].values())


@pytest.mark.timeout(60)
def test_a_non_finite_loss_is_not_sent_with_heartbeats() -> None:
    """The server refuses a heartbeat whose loss is not finite (400): the client leaves it out,
    so a diverged worker keeps heartbeating (and stays a member) and reports no loss."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, allreduce=True)) as srv:
        model = torch.nn.Linear(4, 4)
        with DiLoCoWorker(
            model, torch.optim.SGD(model.parameters(), lr=0.1), srv.address, worker_id="w0"
        ) as w:
            client: DiLoCoClient = w._session.client
            for loss in (math.nan, math.inf, -math.inf):
                client.heartbeat("w0", loss=loss)
            client.heartbeat("w0", loss=2.5)
            shown = {x["worker_id"]: x["loss"] for x in srv.status()["workers"]}
    assert shown == {"w0": 2.5}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("factor", "bound"), [(None, 10.0), (3.0, 3.0)])
def test_the_norm_bound_comes_from_the_servers_clip_norm_factor(
    factor: float | None, bound: float
) -> None:
    """``--clip-norm-factor`` is accepted with ``--allreduce`` (``--trim-fraction`` is not) and
    reaches the worker in its registration reply; unset, the mode's default."""
    with pytest.raises(ValueError, match="--trim-fraction"):
        ServerConfig(allreduce=True, trim_fraction=0.1)
    config = ServerConfig(port=0, num_workers=1, allreduce=True, clip_norm_factor=factor)
    with DiLoCoServer(config) as srv:
        model = torch.nn.Linear(4, 4)
        with DiLoCoWorker(
            model, torch.optim.SGD(model.parameters(), lr=0.1), srv.address, worker_id="w0"
        ) as w:
            strategy: Any = w._strategy
            assert strategy._state.rules.norm_bound == bound
