"""The SparseLoCo outer rule through a real server (issue 30 item 2): two workers upload
``topk`` bodies under ``--outer-rule sparseloco``, and the global parameters are the plain
averaged descent of the decoded uploads, round after round (hand-computed from the captured
bodies); the workers learn the rule at registration and decay their error feedback. The maths
alone: tests/unit/test_outer_rule.py."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.capture import CaptureClient, Captured
from tests.helpers.threads import in_threads

TOPK = "topk:density=0.1,chunk=64,bits=2"
LR = 0.5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def capturing_worker(
    address: str, sync_every: int = 2, **kw: object
) -> tuple[DiLoCoWorker, CaptureClient]:
    model = make_model()
    client = CaptureClient(address)
    worker = DiLoCoWorker(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        address,
        heartbeat_interval=0,
        codec=TOPK,
        client=client,
        sync_every=sync_every,
        **kw,  # type: ignore[arg-type]
    )
    client.worker = worker
    return worker, client


def test_two_topk_workers_get_the_plain_averaged_descent_of_their_decoded_uploads() -> None:
    config = ServerConfig(port=0, num_workers=2, outer_rule="sparseloco", outer_lr=LR)
    rounds = 3
    with DiLoCoServer(config) as server:
        pairs = [capturing_worker(server.address) for _ in range(2)]
        shapes = pairs[0][0]._local.table()
        start = {n: p.detach().clone() for n, p in pairs[0][0].model.named_parameters()}
        published: list[dict[str, torch.Tensor]] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            worker, _ = pairs[i]
            gen = torch.Generator().manual_seed(10 + i)
            with worker:
                for step in range(2 * rounds):
                    for p in worker.model.parameters():
                        p.grad = torch.randn(p.shape, generator=gen)
                    worker.optimizer.step()
                    worker.optimizer.zero_grad()
                    if i == 0 and step % 2 == 1:  # after each sync: the round's parameters
                        with lock:
                            published.append(server.global_params())

        in_threads(2, run)
        status = server.status()
    assert status["outer_rule"] == "sparseloco"
    assert status["outer_optimizer"]["momentum"] == 0.0
    uploads = [[u for u in client.uploads if u.counted] for _, client in pairs]
    assert [len(u) for u in uploads] == [rounds, rounds]
    # Hand-computed: theta_{r+1} = theta_r - lr * (dec(u_r^1) + dec(u_r^2)) / 2, exact in fp32
    # up to the order of the sum and the division, as the server adds then divides.
    theta = {n: t.clone() for n, t in start.items()}
    for r in range(rounds):
        a, b = uploads[0][r].decoded(shapes), uploads[1][r].decoded(shapes)
        for n in theta:
            theta[n] = theta[n] - LR * ((a[n] + b[n]) / 2)
        for n in theta:
            torch.testing.assert_close(published[r][n], theta[n], rtol=0, atol=1e-6)
    # Not vacuous: every round moved the parameters (a server keeping momentum, or adding a
    # round twice, would miss the reference above from the second round on).
    assert all(
        any(not torch.equal(published[r][n], published[r - 1][n]) for n in theta)
        for r in range(1, rounds)
    )
    for worker, client in pairs:
        assert worker._encoder.decay == 0.95  # the paper's, told by the rule
        _assert_decayed_feedback(worker, [u for u in client.uploads if u.counted], shapes)


def _assert_decayed_feedback(
    worker: DiLoCoWorker, uploads: list[Captured], shapes: dict[str, tuple[int, ...]]
) -> None:
    """e_t = decay * e_{t-1} + g_t - dec(u_t): the residual left after the last upload."""
    beta = worker._encoder.decay
    e = {n: torch.zeros(s) for n, s in shapes.items()}
    for up in uploads:
        sent = up.decoded(shapes)
        e = {n: beta * e[n] + up.true[n] - sent[n] for n in shapes}
    fb = worker._encoder.feedback
    assert fb is not None
    for n in shapes:
        torch.testing.assert_close(fb.residuals[n], e[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("rule", "asked", "decay"), [("sgd", None, 1.0), ("sparseloco", 0.5, 0.5)])
def test_the_rule_sets_the_decay_unless_the_worker_set_it(
    rule: str, asked: float | None, decay: float
) -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, outer_rule=rule)) as server:
        worker, _ = capturing_worker(server.address, ef_decay=asked)
        with worker:
            assert worker._encoder.decay == decay
            assert server.status()["outer_rule"] == rule


def test_async_mode_takes_the_rule() -> None:
    config = ServerConfig(port=0, num_workers=1, mode="async", outer_rule="sparseloco", outer_lr=LR)
    with DiLoCoServer(config) as server:
        worker, client = capturing_worker(server.address)
        shapes = worker._local.table()
        start = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        gen = torch.Generator().manual_seed(3)
        with worker:
            for _ in range(2):
                for p in worker.model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                worker.optimizer.step()
                worker.optimizer.zero_grad()
            got = server.global_params()
        (up,) = [u for u in client.uploads if u.counted]
    sent = up.decoded(shapes)
    for n in shapes:
        torch.testing.assert_close(got[n], start[n] - LR * sent[n], rtol=0, atol=1e-6)


@pytest.mark.parametrize("weighting", ["none", "inverse_sqrt"])
def test_async_workers_at_different_speeds_get_the_weighted_plain_descent(weighting: str) -> None:
    """Async mode, two ``topk`` workers syncing every 2 and every 3 steps: each upload is
    applied alone as ``theta -= lr * weight * dec(u)`` (``weight`` the server's staleness
    weight, as the reply names it), in the order the server applied them, with no momentum;
    each worker's residual decays as under sync."""
    config = ServerConfig(
        port=0,
        num_workers=2,
        mode="async",
        outer_rule="sparseloco",
        outer_lr=LR,
        staleness_weighting=weighting,
    )
    with DiLoCoServer(config) as server:
        pairs = [capturing_worker(server.address, sync_every=2 + i) for i in range(2)]
        shapes = pairs[0][0]._local.table()
        start = {n: p.detach().clone() for n, p in pairs[0][0].model.named_parameters()}

        def run(i: int) -> None:
            worker, _ = pairs[i]
            gen = torch.Generator().manual_seed(30 + i)
            with worker:
                for _ in range(12):
                    for p in worker.model.parameters():
                        p.grad = torch.randn(p.shape, generator=gen)
                    worker.optimizer.step()
                    worker.optimizer.zero_grad()

        in_threads(2, run)
        got, status = server.global_params(), server.status()
    assert status["outer_rule"] == "sparseloco" and status["round"] == 10
    applied = []
    for worker, client in pairs:
        assert all(u.counted for u in client.uploads)
        applied += [u for u in client.uploads if u.reply is not None]
        assert worker._encoder.decay == 0.95
        _assert_decayed_feedback(worker, client.uploads, shapes)
    assert [len(c.uploads) for _, c in pairs] == [6, 4]
    applied.sort(key=lambda u: int(u.reply["round"]))  # type: ignore[index]
    assert [int(u.reply["round"]) for u in applied] == list(range(10))  # type: ignore[index]
    theta = {n: t.clone() for n, t in start.items()}
    for up in applied:
        assert up.reply is not None
        weight = float(up.reply["weight"])
        stale = int(up.reply["staleness"])
        assert weight == (1.0 if weighting == "none" else pytest.approx((1 + stale) ** -0.5))
        for n, t in up.decoded(shapes).items():
            theta[n] = theta[n] - LR * (t * weight)
    for n in theta:
        assert not torch.equal(got[n], start[n]), n
        torch.testing.assert_close(got[n], theta[n], rtol=0, atol=1e-5)


def test_streaming_fragments_take_the_rule_piece_by_piece() -> None:
    """Two ``topk`` workers streaming two fragments: each fragment round moves its pieces by
    ``-lr * mean(dec)`` of the two workers' decoded pieces and nothing else, and each worker's
    residual decays only over the range each upload compensated."""
    config = ServerConfig(
        port=0, num_workers=2, num_fragments=2, outer_rule="sparseloco", outer_lr=LR
    )
    with DiLoCoServer(config) as server:
        pairs = [capturing_worker(server.address, sync_every=4, num_fragments=2) for _ in range(2)]
        shapes = pairs[0][0]._local.table()
        start = {n: p.detach().clone() for n, p in pairs[0][0].model.named_parameters()}

        def run(i: int) -> None:
            worker, _ = pairs[i]
            gen = torch.Generator().manual_seed(40 + i)
            worker.start()
            for _ in range(12):  # six fragment rounds, each closed within its due step (tau 0)
                for p in worker.model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                worker.optimizer.step()
                worker.optimizer.zero_grad()
            worker.stop(submit=False)  # no exit upload: every round had both workers

        in_threads(2, run)
        got = server.global_params()
    theta = {n: t.clone().view(-1) for n, t in start.items()}
    for worker, client in pairs:
        assert all(u.counted for u in client.uploads) and len(client.uploads) == 6
        assert {u.fragment for u in client.uploads} == {0, 1}
        plan = {p.wire_name: p for frag in worker._strategy.plan for p in frag}  # type: ignore[attr-defined]
        beta = worker._encoder.decay
        assert beta == 0.95
        e = {n: torch.zeros(s).view(-1) for n, s in shapes.items()}
        for up in client.uploads:
            pieces = {w: (plan[w].numel,) for w in up.true}
            for w, sent in up.decoded(pieces).items():
                p = plan[w]
                theta[p.param][p.start : p.stop] -= LR * (sent / 2)
                span = e[p.param][p.start : p.stop]
                span.copy_(beta * span + up.true[w] - sent)
        fb = worker._encoder.feedback
        assert fb is not None
        for n in shapes:
            torch.testing.assert_close(fb.residuals[n].view(-1), e[n], rtol=1e-5, atol=1e-6)
    for n in theta:
        assert not torch.equal(got[n], start[n]), n
        torch.testing.assert_close(got[n].view(-1), theta[n], rtol=0, atol=1e-5)
