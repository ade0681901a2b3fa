"""The quantized all-reduce's residuals across a member's restart and without error feedback,
and the SparseLoCo rule in all-reduce mode (docs/design/allreduce.md, "Quantized all-reduce"):
real workers in threads against a server in ``--allreduce`` mode."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker import resume
from diloco.worker.allreduce.quantized import Residuals
from tests.helpers.allreduce import EVERY, make_model, run_faulty, run_workers
from tests.helpers.threads import in_threads

MAX_ROUNDS = 40
"""The member that stays trains at most this many rounds (it stops once the other is done)."""


def spy_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[Residuals, float, list[torch.Tensor]]]:
    """Every quantized round's (residuals object, decay, copies of the residuals it sends)."""
    uses: list[tuple[Residuals, float, list[torch.Tensor]]] = []
    original = Residuals.for_round

    def for_round(self: Residuals, comm: str, share: int, tensors: Any, decay: float = 1.0) -> Any:
        q = original(self, comm, share, tensors, decay)
        if q is not None:
            uses.append((self, decay, [e.clone() for e in q.residual or ()]))
        return q

    monkeypatch.setattr(Residuals, "for_round", for_round)
    return uses


def grads(model: torch.nn.Module, gen: torch.Generator) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.timeout(240)
def test_a_member_restarted_between_rounds_sends_the_residual_it_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8, two members. Member w1 saves its checkpoint (``resume.save``) after its second
    round and stops; w0 goes on alone. A new w1 resumes from the checkpoint
    (``resume.start_resumed``): its join receives the run's state from w0 (a rebase, which keeps
    the residuals), and the first round it averages sends exactly the residual it saved, bit for
    bit (nonzero: without the checkpoint's it would send zeros). Afterwards both members hold
    the same state after every round they share."""
    uses = spy_rounds(monkeypatch)
    folder = str(tmp_path)
    done = threading.Event()
    states: dict[str, dict[int, list[torch.Tensor]]] = {"w0": {}, "w1": {}}

    def note(w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        held = [*w._local.snapshot.values(), *strategy._state.momentum]
        states[w.worker_id or ""][w.base_round] = [t.clone() for t in held]

    def make(model: torch.nn.Module, opt: torch.optim.Optimizer, address: str) -> DiLoCoWorker:
        return DiLoCoWorker(
            model, opt, address, sync_every=EVERY, heartbeat_interval=0.2, codec="int8",
            worker_id="w1",
        )  # fmt: skip

    def stays(address: str) -> None:
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100)
        with DiLoCoWorker(
            model, opt, address, sync_every=EVERY, heartbeat_interval=0.2, codec="int8",
            worker_id="w0",
        ) as w:  # fmt: skip
            for _ in range(MAX_ROUNDS * EVERY):
                grads(model, gen)
                opt.step()
                if w.local_step == 0:
                    note(w)
                    if done.is_set():
                        return

    def restarts(address: str) -> tuple[dict[str, torch.Tensor], DiLoCoWorker]:
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(101)
        with make(model, opt, address) as w:
            for _ in range(2 * EVERY):
                grads(model, gen)
                opt.step()
            assert w.local_step == 0 and w.base_round == 2
            resume.save(w, folder)
            strategy: Any = w._strategy
            saved = strategy.residuals.state_dict()
        # The restart: a new process would build the model from its own checkpoint; here the
        # model is the snapshot (no local step since the last round).
        state, snapshot = resume.load(folder) or (None, None)
        model = make_model(5)
        model.load_state_dict(dict(snapshot or {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        again = make(model, opt, address)
        resume.start_resumed(again, state, snapshot, resume.load_codec_state(folder))
        try:
            for _ in range(2 * EVERY):
                grads(model, gen)
                opt.step()
                if again.local_step == 0:
                    note(again)
        finally:
            again.stop(submit=True)
            done.set()
        return saved, again

    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        got = in_threads(2, lambda i: stays(srv.address) if i == 0 else restarts(srv.address))
    saved, again = got[1]
    assert saved and any(bool(t.any()) for t in saved.values())
    mine: Any = again._strategy
    first = next(sent for owner, _, sent in uses if owner is mine.residuals)
    assert len(first) == len(saved)
    for i, e in enumerate(first):
        assert torch.equal(e, saved[f"quorum_residual/0/{i}"]), i
    m = again.sync_metrics
    assert m["rebases"] >= 1 and m["rounds"] >= 1  # its join took the run's state
    shared = set(states["w0"]) & set(states["w1"])
    assert shared
    for r in shared:
        for a, b in zip(states["w0"][r], states["w1"][r], strict=True):
            assert torch.equal(a, b), r


@pytest.mark.timeout(240)
def test_a_member_that_takes_the_state_wholesale_drops_its_residual(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int8, two members. w1's model goes NaN before its rounds 2, 3 and 4: each leaves it out
    (it keeps its residual: it sent none of it), the third until it registers again, and at its
    rejoin it takes the run's state wholesale (``take_state``), dropping its residual: the round
    before sent a nonzero one, the next sends zeros. A rebase keeps it (the restart test)."""
    events: list[tuple[Residuals, str, list[torch.Tensor]]] = []
    original_round, original_forget = Residuals.for_round, Residuals.forget

    def for_round(self: Residuals, comm: str, share: int, tensors: Any, decay: float = 1.0) -> Any:
        q = original_round(self, comm, share, tensors, decay)
        if q is not None:
            events.append((self, "round", [e.clone() for e in q.residual or ()]))
        return q

    def forget(self: Residuals) -> None:
        events.append((self, "forget", []))
        original_forget(self)

    monkeypatch.setattr(Residuals, "for_round", for_round)
    monkeypatch.setattr(Residuals, "forget", forget)

    def fault(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank == 1 and step in (2 * EVERY - 1, 3 * EVERY - 1, 4 * EVERY - 1):
            with torch.no_grad():
                for p in w._local.params.values():
                    p.fill_(float("nan"))

    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        results, _ = run_faulty(srv.address, 2, 7, fault, codec="int8")
    assert results[1]["metrics"]["excluded_rounds"] == 3
    forgetting = {id(owner) for owner, what, _ in events if what == "forget"}
    assert len(forgetting) == 1  # w1's alone, once
    mine = [(what, sent) for owner, what, sent in events if id(owner) in forgetting]
    at = [what for what, _ in mine].index("forget")
    assert [what for what, _ in mine].count("forget") == 1
    before = mine[at - 1][1]
    after = mine[at + 1][1]
    assert mine[at - 1][0] == mine[at + 1][0] == "round"
    assert any(bool(e.any()) for e in before)
    assert not any(bool(e.any()) for e in after)


@pytest.mark.timeout(240)
def test_without_error_feedback_members_send_keep_and_save_no_residual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8, two members with ``error_feedback=False``, 2 rounds: no round of either gets a
    residual to send or a buffer for a new one, and each member's checkpoint after round 2
    (``resume.save``) holds no ``quorum_residual/`` key, as in server mode."""
    sent: list[tuple[Any, Any]] = []
    original = Residuals.for_round

    def for_round(self: Residuals, comm: str, share: int, tensors: Any, decay: float = 1.0) -> Any:
        q = original(self, comm, share, tensors, decay)
        if q is not None:
            sent.append((q.residual, q.pending))
        return q

    monkeypatch.setattr(Residuals, "for_round", for_round)
    saved: dict[int, dict[str, torch.Tensor] | None] = {}

    def save(rank: int, r: int, w: DiLoCoWorker) -> None:
        if r == 2:
            folder = tmp_path / f"w{rank}"
            folder.mkdir()
            resume.save(w, str(folder))
            saved[rank] = resume.load_codec_state(str(folder))

    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        results = run_workers(
            srv.address, 2, 2, after_sync=save, codec="int8", error_feedback=False
        )
    assert [m["rounds"] for _, m in results] == [2, 2]
    # Each member: its join's round (weights summing to 0) and its 2 rounds.
    assert len(sent) == 6 and all(q == (None, None) for q in sent)
    assert sorted(saved) == [0, 1]
    for state in saved.values():
        assert not any(k.startswith("quorum_residual/") for k in state or {})


def sparseloco_run(
    monkeypatch: pytest.MonkeyPatch, **server: Any
) -> tuple[list[Any], dict[int, list[list[torch.Tensor]]], list[float]]:
    """Two topk members, 3 rounds: results, each member's state after each round, and the
    decay of every quantized round."""
    uses = spy_rounds(monkeypatch)
    seen: dict[int, list[list[torch.Tensor]]] = {}
    lock = threading.Lock()

    def record(rank: int, r: int, w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        state = [t.clone() for t in [*w._local.snapshot.values(), *strategy._state.momentum]]
        with lock:
            seen.setdefault(w.base_round, []).append(state)

    worker = server.pop("worker", {})
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True, **server)) as srv:
        results = run_workers(srv.address, 2, 3, after_sync=record, codec="topk", **worker)
    return results, seen, [decay for _, decay, _ in uses]


@pytest.mark.timeout(240)
def test_sparseloco_in_allreduce_mode_is_plain_descent_with_decayed_quorum_residuals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--outer-rule sparseloco --allreduce`` with topk: every member keeps no momentum, sends
    its quorum residual decayed by the rule's 0.95, and holds the same bits as the others after
    every round; the run is bit for bit the one declared by hand (``--outer-momentum 0`` under
    ``sgd`` with the workers' ``ef_decay=0.95``), so the rule is that arithmetic and nothing
    else."""
    results, seen, decays = sparseloco_run(monkeypatch, outer_rule="sparseloco")
    assert sorted(seen) == [1, 2, 3]
    for r, states in seen.items():
        assert len(states) == 2
        assert len(states[0]) == len(results[0][0])  # the snapshot alone: no momentum buffer
        for a, b in zip(*states, strict=True):
            assert torch.equal(a, b), r
    assert decays and set(decays) == {0.95}
    for _, m in results:
        assert m["rounds"] == 3 and m["failed_syncs"] == 0
    by_hand, seen_by_hand, decays_by_hand = sparseloco_run(
        monkeypatch, outer_momentum=0.0, worker={"ef_decay": 0.95}
    )
    assert set(decays_by_hand) == {0.95}
    for (params, _), (ref, _) in zip(results, by_hand, strict=True):
        for k in ref:
            assert torch.equal(params[k], ref[k]), k
    plain, _, decays_plain = sparseloco_run(monkeypatch, outer_momentum=0.0)
    assert set(decays_plain) == {1.0}  # the control: without the decay the run differs
    assert not all(torch.equal(plain[0][0][k], results[0][0][k]) for k in plain[0][0])
