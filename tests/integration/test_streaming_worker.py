"""Streaming DiLoCo on the worker, against an in-process fake of the server's fragment protocol.

The fake applies each fragment upload at once (one worker, sync mode) with plain SGD
``global -= outer_lr * pseudo_gradient``, so every expected value below is worked out by hand.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.core import merge_
from diloco.core.fragments import Piece, Schedule, split_sequential
from diloco.wire import TensorSpec, build_layout, byte_view
from diloco.worker.server_mode.fragment_plan import plan_from_server
from diloco.worker.transport.client import Conflict, Download, Unreachable

D = 0.25  # every element moves by D per inner step (SGD lr 1 on a constant gradient -D)


class FakeServer:
    """One worker's view of a streaming server: fragments planned like the real one."""

    def __init__(self, num_fragments: int = 2, outer_lr: float = 0.5) -> None:
        self.num_fragments = num_fragments
        self.outer_lr = outer_lr
        self.params: dict[str, torch.Tensor] | None = None
        self.plan: list[list[list[Any]]] = []
        self.rounds: list[int] = []
        self.submissions: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        self.refuse: dict[int, dict[str, Any]] = {}  # fragment -> 409 body, used once
        self.fail_submit: set[int] = set()  # fragments whose next upload is unreachable
        self.fail_download: set[int] = set()  # fragments whose next download is unreachable
        self.lose_reply: set[int] = set()  # fragments whose next upload counts, answer lost
        self.counted: dict[str, int] = {}  # submission id -> round it counted in
        self.gate: threading.Event | None = None  # uploads wait on it when set
        #: Fragments whose next upload is acknowledged past an async age gate: counted, not applied.
        self.age_gate: set[int] = set()
        self.entered = threading.Event()
        self.active = 0
        self.max_active = 0
        self.recommend: int | None = None
        self._lock = threading.Lock()

    def seed(self, tensors: dict[str, torch.Tensor]) -> None:
        self.params = {n: t.detach().clone().float() for n, t in tensors.items()}
        sizes = [(n, t.numel()) for n, t in self.params.items()]
        self.plan = [
            [[f"{s.name}[{s.start}:{s.stop}]", s.name, s.start, s.stop] for s in frag]
            for frag in split_sequential(sizes, self.num_fragments)
        ]
        self.rounds = [0] * self.num_fragments

    def view(self, wire: list[Any]) -> torch.Tensor:
        assert self.params is not None
        _, param, start, stop = wire
        return self.params[param].view(-1)[start:stop]


class FakeClient:
    def __init__(self, server: FakeServer) -> None:
        self.s = server
        self.bytes_up = 0
        self.bytes_down = 0
        self.retry_count = 0

    def _reply(self) -> dict[str, Any]:
        s = self.s
        out: dict[str, Any] = {
            "mode": "sync",
            "fragments": s.plan or None,
            "fragment_rounds": s.rounds or None,
        }
        if s.recommend is not None:
            out["recommended_sync_every"] = s.recommend
        return out

    def register(self, worker_id: Any, **_: Any) -> dict[str, Any]:
        has = self.s.params is not None
        table = [[n, list(t.shape)] for n, t in self.s.params.items()] if has else None
        return {"worker_id": "w0", "round": 0, "has_params": has, "params": table, **self._reply()}

    def upload_initial(self, worker_id: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.s.seed(tensors)
        return {"status": "ok", **self._reply()}

    def heartbeat(self, *a: Any, **k: Any) -> dict[str, Any]:
        return {"status": "ok"}

    def deregister(self, worker_id: str) -> dict[str, Any]:
        return {"status": "ok"}

    def close(self) -> None:
        pass

    def download(
        self,
        into: Any,
        *,
        min_round: int = 0,
        worker_id: Any = None,
        fragment: Any = None,
        on_progress: Any = None,
        have_round: int | None = None,
    ) -> Download:
        assert have_round is None  # full parameters only: no compressed downlink here
        s = self.s
        assert s.params is not None
        if fragment is None:
            tensors = dict(s.params)
            meta = {"round": "0", "fragment_rounds": ",".join(map(str, s.rounds))}
        else:
            if fragment in s.fail_download:
                s.fail_download.discard(fragment)
                raise Unreachable("fake: link down")
            assert s.rounds[fragment] >= min_round, "the fake closes rounds at once"
            tensors = {w[0]: s.view(w).clone() for w in s.plan[fragment]}
            meta = {"round": str(s.rounds[fragment]), "fragment": str(fragment)}
        layout = build_layout(
            [TensorSpec(n, "F32", tuple(t.shape)) for n, t in tensors.items()], meta
        )
        memory = into(layout)
        for spec, (begin, end) in zip(layout.specs, layout.offsets, strict=True):
            memory[begin:end] = byte_view(tensors[spec.name].contiguous())
            if on_progress is not None:
                on_progress(end)  # the real client reports in payload order as bytes land
        self.bytes_down += layout.total_size
        return Download(int(meta["round"]), "fake", layout, layout.total_size)

    def submit_pseudogradients(
        self,
        worker_id: str,
        base_round: int,
        submission_id: str,
        specs: list[TensorSpec],
        produce: Any,
        *,
        weight: float = 1.0,
        tokens: float | None = None,
        fragment: int | None = None,
        loss: float | None = None,
        steps: int | None = None,
        codec: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        s = self.s
        assert fragment is not None
        with s._lock:
            s.active += 1
            s.max_active = max(s.max_active, s.active)
        try:
            s.entered.set()
            if s.gate is not None:
                assert s.gate.wait(30)
            if fragment in s.fail_submit:
                s.fail_submit.discard(fragment)
                raise Unreachable("fake: link down")
            if fragment in s.refuse:
                raise Conflict(409, s.refuse.pop(fragment))
            if submission_id in s.counted:
                return {
                    "status": "duplicate",
                    "round": s.counted[submission_id],
                    "fragment": fragment,
                }
            got = {spec.name: produce(spec).float().clone() for spec in specs}
            if base_round != s.rounds[fragment]:
                body = {"error": "stale_round", "detail": "", "action": "rebase"}
                raise Conflict(409, {**body, "round": s.rounds[fragment]})
            assert sorted(got) == sorted(w[0] for w in s.plan[fragment])
            if fragment in s.age_gate:  # the receipt of an async server's age gate
                s.age_gate.discard(fragment)
                s.counted[submission_id] = now = s.rounds[fragment] - 1
                return {"status": "accepted", "round": now, "version": now + 1, "weight": 0.0}
            s.submissions.append((fragment, base_round, got))
            for wire in s.plan[fragment]:
                s.view(wire).sub_(s.outer_lr * got[wire[0]])
            s.rounds[fragment] += 1
            s.counted[submission_id] = base_round
            self.bytes_up += build_layout(specs).total_size
            if fragment in s.lose_reply:
                s.lose_reply.discard(fragment)
                raise Unreachable("fake: counted, then the link went down")
            return {"status": "accepted", "round": base_round, "fragment": fragment}
        finally:
            with s._lock:
                s.active -= 1


def make_worker(
    server: FakeServer, **kw: Any
) -> tuple[DiLoCoWorker, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(
        3, 2
    )  # weight 6 elements, bias 2: fragments weight[0:4] | weight[4:6]+bias
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3))
        model.bias.copy_(torch.tensor([10.0, 20.0]))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    settings: dict[str, Any] = {"sync_every": 4, "num_fragments": 2, "merge_alpha": 0.5}
    settings.update(kw)
    worker = DiLoCoWorker(
        model,
        opt,
        "fake:1",
        bf16_comm=False,
        heartbeat_interval=0,
        client=FakeClient(server),  # type: ignore[arg-type]
        **settings,
    )
    return worker, model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, -D)
    opt.step()
    opt.zero_grad()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([model.weight.detach().view(-1), model.bias.detach().view(-1)])


START = torch.tensor([0.0, 1, 2, 3, 4, 5, 10, 20])
F0 = slice(0, 4)  # fragment 0's elements in flat(model); fragment 1 is 4:8


# --- pure parts -------------------------------------------------------------------------------


def test_merge_by_hand() -> None:
    local = torch.tensor([1.0, 2.0])
    snapshot = torch.tensor([0.0, 0.0])
    merge_(local, snapshot, torch.tensor([3.0, 5.0]), 0.5)
    torch.testing.assert_close(local, torch.tensor([2.0, 3.5]))
    torch.testing.assert_close(snapshot, torch.tensor([3.0, 5.0]))
    local = torch.tensor([1.0, 2.0])
    merge_(local, snapshot, torch.tensor([-1.0, 7.0]), 0.0)  # alpha 0: plain overwrite
    torch.testing.assert_close(local, torch.tensor([-1.0, 7.0]))
    local = torch.tensor([1.0, 2.0])
    merge_(local, snapshot, torch.tensor([-1.0, 7.0]), 0.75)
    torch.testing.assert_close(local, torch.tensor([0.5, 3.25]))


@pytest.mark.parametrize(("sync_every", "num_fragments"), [(7, 3), (6, 3), (4, 2), (5, 5), (9, 1)])
def test_schedule_sends_every_fragment_once_per_period(sync_every: int, num_fragments: int) -> None:
    schedule = Schedule(sync_every, num_fragments)
    periods = 4
    due = [schedule.advance() for _ in range(sync_every * periods)]
    for p in range(periods):
        period = [f for f in due[p * sync_every : (p + 1) * sync_every] if f is not None]
        assert period == list(range(num_fragments))
    assert schedule.phase == 0


def test_schedule_seven_steps_three_fragments_by_hand() -> None:
    schedule = Schedule(7, 3)
    assert [schedule.advance() for _ in range(7)] == [None, 0, None, 1, None, None, 2]


def test_plan_from_server_checks_coverage() -> None:
    table = {"w": (2, 3), "b": (2,)}
    good = [[["w[0:4]", "w", 0, 4]], [["w[4:6]", "w", 4, 6], ["b[0:2]", "b", 0, 2]]]
    assert plan_from_server(good, table)[1][1] == Piece("b[0:2]", "b", 1, 0, 2, (2,))
    with pytest.raises(ValueError, match="gap or an overlap"):
        plan_from_server(
            [[["w[0:4]", "w", 0, 4]], [["w[3:6]", "w", 3, 6], ["b", "b", 0, 2]]], table
        )
    with pytest.raises(ValueError, match="cover all"):
        plan_from_server(
            [[["w[0:4]", "w", 0, 4]], [["w[4:6]", "w", 4, 6], ["b", "b", 0, 1]]], table
        )
    with pytest.raises(ValueError, match="does not fit"):
        plan_from_server([[["x", "x", 0, 4]], [["b", "b", 0, 2]]], table)


# --- the worker against the fake ------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_tau0_merge_by_hand(alpha: float) -> None:
    server = FakeServer(outer_lr=0.5)
    worker, model, opt = make_worker(server, merge_alpha=alpha)
    with worker:
        step(model, opt)
        step(model, opt)  # fragment 0 due: pg = -2D, global = start + 0.5 * 2D = start + D
        got = flat(model)
        mixed = alpha * (START + 2 * D) + (1 - alpha) * (START + D)
        torch.testing.assert_close(got[F0], mixed[F0])
        torch.testing.assert_close(got[4:], START[4:] + 2 * D)  # fragment 1 untouched
        assert worker._local.snapshot["weight"].view(-1)[:4].tolist() == (START[F0] + D).tolist()
        fragment, base_round, sent = server.submissions[0]
        assert (fragment, base_round) == (0, 0)
        torch.testing.assert_close(sent["weight[0:4]"], torch.full((4,), -2 * D))
        step(model, opt)
        step(model, opt)  # fragment 1 due after 4 steps: pg = -4D, global = start + 2D
        got = flat(model)
        mixed1 = alpha * (START + 4 * D) + (1 - alpha) * (START + 2 * D)
        torch.testing.assert_close(got[4:], mixed1[4:])
        torch.testing.assert_close(got[F0], mixed[F0] + 2 * D)
        m = worker.sync_metrics
        assert (m["fragments_sent"], m["rounds"]) == (2, 2)
        assert m["stalls"] <= 2  # tau 0: the loop waits for each exchange unless it is back
        assert server.rounds == [1, 1]
        assert 0 < m["peak_sync_bytes_up"] < m["bytes_up"]


def test_a_fragment_past_the_age_gate_takes_the_served_values_and_its_steps_are_dropped() -> None:
    server = FakeServer(outer_lr=0.5)
    worker, model, opt = make_worker(server, merge_alpha=0.0)
    with worker:
        for _ in range(4):  # fragment 0 sent at step 2 (global start + D), fragment 1 at step 4
            step(model, opt)
        assert worker.sync_metrics["dropped_steps"] == 0
        server.age_gate = {0}
        step(model, opt)
        step(model, opt)  # fragment 0's 4 steps since: acknowledged, nothing applied
        torch.testing.assert_close(flat(model)[F0], START[F0] + D)  # the served values
        assert server.rounds == [1, 1] and len(server.submissions) == 2
        assert worker.sync_metrics["dropped_steps"] == 4


def test_tau1_merges_one_step_later_keeping_alpha_of_the_steps_in_flight() -> None:
    server = FakeServer(outer_lr=0.5)
    worker, model, opt = make_worker(server, merge_alpha=0.5, overlap_steps=1)
    with worker:
        step(model, opt)
        step(model, opt)  # fragment 0 sent (local start+2D), global becomes start+D
        torch.testing.assert_close(flat(model)[F0], START[F0] + 2 * D)  # not merged yet
        step(model, opt)  # merged after this step: 0.5 * (start+3D) + 0.5 * (start+D)
        torch.testing.assert_close(flat(model)[F0], START[F0] + 2 * D)
        torch.testing.assert_close(worker._local.snapshot["weight"].view(-1)[:4], START[F0] + D)
        step(model, opt)  # fragment 1 sent; pending until step 5
        step(model, opt)
        torch.testing.assert_close(
            flat(model)[4:], 0.5 * (START[4:] + 5 * D) + 0.5 * (START[4:] + 2 * D)
        )


def test_one_fragment_in_flight_and_the_stall_is_counted() -> None:
    server = FakeServer(outer_lr=1.0)
    # tau 5 > the 1 step between fragments: fragment 1 comes due while fragment 0 is still out.
    worker, model, opt = make_worker(server, sync_every=2, overlap_steps=5)
    with worker:
        server.gate = threading.Event()
        step(model, opt)  # fragment 0 goes to the sender thread, which blocks in the upload
        assert server.entered.wait(10)
        second = threading.Thread(target=step, args=(model, opt))
        second.start()  # fragment 1 is due: this step must wait for fragment 0
        while worker.metrics["stalls"] == 0:
            time.sleep(0.001)
        assert second.is_alive()
        server.gate.set()
        second.join(10)
        assert not second.is_alive()
        assert server.max_active == 1
        m = worker.sync_metrics
        assert m["stalls"] == 1 and m["stall_time_s"] > 0 and m["fragments_sent"] == 2
    assert [f for f, _, _ in server.submissions][:2] == [0, 1]
    assert server.max_active == 1


def test_rebase_keeps_local_progress_on_top_of_the_new_values() -> None:
    server = FakeServer(outer_lr=1.0)
    worker, model, opt = make_worker(server)
    with worker:
        assert server.params is not None
        server.params["weight"].view(-1)[:4] += 100.0  # others moved fragment 0 on
        server.rounds[0] = 3
        server.refuse[0] = {"error": "stale_round", "detail": "", "action": "rebase", "round": 3}
        step(model, opt)
        step(model, opt)  # refused: download fragment 0, keep local - snapshot (2D) on top
        torch.testing.assert_close(flat(model)[F0], START[F0] + 100.0 + 2 * D)
        torch.testing.assert_close(worker._local.snapshot["weight"].view(-1)[:4], START[F0] + 100.0)
        m = worker.sync_metrics
        assert (m["rebases"], m["refused_submissions"], m["rounds"]) == (1, 1, 0)
        step(model, opt)
        step(model, opt)  # fragment 1 syncs normally
        step(model, opt)
        step(model, opt)  # fragment 0 again, against round 3: the kept 2D plus 4 new steps
        fragment, base_round, sent = server.submissions[-1]
        assert (fragment, base_round) == (0, 3)
        torch.testing.assert_close(sent["weight[0:4]"], torch.full((4,), -6 * D))


def test_refused_with_continue_leaves_everything_alone() -> None:
    server = FakeServer()
    worker, model, opt = make_worker(server)
    with worker:
        server.refuse[0] = {"error": "not_expected", "detail": "", "action": "continue", "round": 0}
        step(model, opt)
        step(model, opt)
        torch.testing.assert_close(flat(model), START + 2 * D)
        assert worker.sync_metrics["refused_submissions"] == 1


def test_unreachable_server_keeps_progress_and_training_goes_on() -> None:
    server = FakeServer()
    worker, model, opt = make_worker(server)
    with worker:
        server.fail_submit.add(0)
        step(model, opt)
        step(model, opt)
        torch.testing.assert_close(flat(model), START + 2 * D)
        torch.testing.assert_close(worker._local.snapshot["weight"].view(-1)[:4], START[F0])
        assert worker.sync_metrics["failed_syncs"] == 1


def test_counted_upload_whose_result_never_came_stays_and_goes_again_under_its_id() -> None:
    """The server holds a counted upload in memory only until its round closes; if that round's
    result never arrives, the progress stays in the model and the fragment's next upload goes
    under the same id. The server answers "duplicate": the steps mixed in since are dropped and
    counted."""
    server = FakeServer(outer_lr=1.0)
    worker, model, opt = make_worker(server, overlap_steps=1, merge_alpha=0.0)
    with worker:
        server.fail_download.add(0)
        step(model, opt)
        step(model, opt)  # fragment 0 sent (-2D) and counted; its download fails
        step(model, opt)  # the outcome is applied: the 2 counted steps stay, with step 3
        torch.testing.assert_close(flat(model)[F0], START[F0] + 3 * D)
        torch.testing.assert_close(flat(model)[4:], START[4:] + 3 * D)
        assert worker.sync_metrics["failed_syncs"] == 1
        assert server.rounds[0] == 1  # the server holds them: they come back with round 1
        for _ in range(4):  # fragment 0 is sent again after step 6 under the same id: a
            step(model, opt)  # duplicate; after step 7 round 1 (start + 2D) is merged
        torch.testing.assert_close(flat(model)[F0], START[F0] + 2 * D)  # counted once
        assert len([s for s in server.submissions if s[0] == 0]) == 1
        m = worker.sync_metrics
        assert (m["dropped_steps"], m["rebases"]) == (4, 0)  # steps 3 to 6 of fragment 0


def test_upload_counted_but_answer_lost_is_resent_under_its_id_not_counted_twice() -> None:
    server = FakeServer(outer_lr=1.0)
    worker, model, opt = make_worker(server, merge_alpha=0.0)
    with worker:
        server.lose_reply.add(0)
        step(model, opt)
        step(model, opt)  # fragment 0 sent (-2D): counted by the server, the answer lost
        assert worker.sync_metrics["failed_syncs"] == 1 and server.rounds[0] == 1
        torch.testing.assert_close(flat(model)[F0], START[F0] + 2 * D)  # nothing known: kept
        for _ in range(4):  # fragment 0 is due again after step 6: sent under the same id
            step(model, opt)
        # The server says duplicate: the first upload counted (round 0 -> START + 2D), and the
        # merge adopts it; the 2D are in the parameters once, not rebased on top a second time.
        assert len([s for s in server.submissions if s[0] == 0]) == 1
        torch.testing.assert_close(flat(model)[F0], START[F0] + 2 * D)
        assert worker.sync_metrics["rebases"] == 0


def test_exit_sends_every_fragments_remaining_steps() -> None:
    server = FakeServer(outer_lr=1.0)
    worker, model, opt = make_worker(server, merge_alpha=0.0)
    with worker:
        for _ in range(5):
            step(model, opt)
    assert [(f, r) for f, r, _ in server.submissions] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    _, _, last0 = server.submissions[2]
    _, _, last1 = server.submissions[3]
    torch.testing.assert_close(last0["weight[0:4]"], torch.full((4,), -3 * D))  # steps 3, 4, 5
    torch.testing.assert_close(last1["bias[0:2]"], torch.full((2,), -D))  # step 5


def test_dylu_retimes_the_schedule_between_periods() -> None:
    server = FakeServer()
    worker, model, opt = make_worker(server, dylu=True)
    server.recommend = 6
    with worker:
        sent_after = []
        for t in range(1, 11):
            before = worker.sync_metrics["fragments_sent"]
            step(model, opt)
            if worker.sync_metrics["fragments_sent"] > before:
                sent_after.append(t)
        assert worker.sync_every == 6
    assert sent_after == [2, 4, 7, 10]
