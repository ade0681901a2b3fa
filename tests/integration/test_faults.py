"""Connections cut mid-upload and mid-download: retried, counted once, no progress lost."""

from __future__ import annotations

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.faultproxy import Fault, FaultProxy


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(64, 64)  # ~16 KB of fp32: bodies span many TCP segments


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, delta: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, -delta)
    opt.step()
    opt.zero_grad()


@pytest.fixture
def setup():
    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    ).start()
    proxy = FaultProxy(server.port)
    yield server, proxy
    proxy.close()
    server.stop()


RETRIES = 3
# An upload's first answer is the interim "100 Continue" (the body follows it); its reply's
# bytes come after.
CONTINUE = len(b"HTTP/1.1 100 Continue\r\n\r\n")


def _worker(proxy: FaultProxy, model: torch.nn.Module, opt: torch.optim.Optimizer) -> DiLoCoWorker:
    client = DiLoCoClient(proxy.address, retries=RETRIES, backoff=0.01, read_timeout=10)
    return DiLoCoWorker(
        model,
        opt,
        proxy.address,
        sync_every=2,
        heartbeat_interval=0,
        bf16_comm=False,
        client=client,
    )


def _on_every_attempt(proxy: FaultProxy, fault: Fault) -> None:
    """The fault on the first try and on each of the worker's retries of that request."""
    for _ in range(1 + RETRIES):
        proxy.add(Fault(fault.direction, fault.after, fault.prefix))


@pytest.mark.parametrize("cut_after", [100, 9000])
def test_upload_cut_midway_is_retried_and_counted_once(setup, cut_after: int) -> None:
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        proxy.add(Fault("up", cut_after, prefix=b"POST /submit_pseudograd"))
        step(model, opt, 0.5)
        step(model, opt, 0.5)
        assert proxy.fired, "the fault never fired"
        m = w.sync_metrics
        assert (
            m["rounds"] == 1 and m["retries"] >= 1 and m["failed_syncs"] == 0 and m["rebases"] == 0
        )
    st = server.status()
    # Round 0 got exactly one contribution; with outer lr 1 the global params moved by exactly +1.
    assert st["round"] == 1 and st["last_round_contributions"] == 1
    for name, t in server.global_params().items():
        torch.testing.assert_close(t, start[name] + 1.0)


@pytest.mark.parametrize(
    "cut_down_after",
    [5, CONTINUE + 5],
    ids=["inside the 100: no body went", "the reply: the whole body went and counted"],
)
def test_upload_cut_on_the_way_down_is_retried_and_counted_once(setup, cut_down_after: int) -> None:
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        proxy.add(Fault("down", cut_down_after, prefix=b"POST /submit_pseudograd"))
        step(model, opt, 0.25)
        step(model, opt, 0.25)
        assert proxy.fired
        m = w.sync_metrics
        assert (
            m["rounds"] == 1
            and m["retries"] >= 1
            and m["failed_syncs"] == 0
            and m["rebases"] == 0
            and m["refused_submissions"] == 0
        )
    st = server.status()
    assert st["round"] == 1 and st["last_round_contributions"] == 1
    for name, t in server.global_params().items():
        torch.testing.assert_close(t, start[name] + 0.5)


@pytest.mark.parametrize("cut_after", [10, 12000])
def test_download_cut_midway_is_retried(setup, cut_after: int) -> None:
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        proxy.add(Fault("down", cut_after, prefix=b"GET /global_params?min_round=1"))
        step(model, opt, 0.5)
        step(model, opt, 0.5)
        assert proxy.fired
        assert w.sync_metrics["rounds"] == 1 and w.sync_metrics["retries"] >= 1
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), start[name] + 1.0)
    assert server.status()["round"] == 1


@pytest.mark.parametrize(
    ("cut_after", "dropped", "final_round"),
    [
        # Cut before the payload: the old snapshot is intact and the counted steps stay in the
        # model (the server holds them only in memory until round 1 is durable). The next sync
        # sends them again under the same id: "duplicate", so the steps mixed in since are
        # dropped (and counted), and round 1 is adopted.
        (10, 2, 1),
        # Cut inside the payload: round 1 was published, so the worker first fetches it in full;
        # its next upload is then on time and closes round 2.
        (12000, 0, 2),
    ],
)
def test_counted_upload_is_not_counted_again_after_its_download_failed(
    setup, cut_after: int, dropped: int, final_round: int
) -> None:
    """The upload is counted, then every download attempt breaks. Training goes on, but the
    counted steps must not count a second time."""
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        _on_every_attempt(proxy, Fault("down", cut_after, prefix=b"GET /global_params?min_round=1"))
        step(model, opt, 0.5)
        step(model, opt, 0.5)  # sync: +1 counted, round 1 closes, its download fails
        assert len(proxy.fired) == 4
        assert server.status()["round"] == 1
        for name, t in server.global_params().items():
            torch.testing.assert_close(t, start[name] + 1.0)
        step(model, opt, 0.25)
        step(model, opt, 0.25)
        m = w.sync_metrics
        assert m["failed_syncs"] == 1 and m["refused_submissions"] == 0
        assert m["dropped_steps"] == dropped
        for name, p in model.named_parameters():  # every step in the parameters exactly once
            torch.testing.assert_close(p.detach(), start[name] + 1.5 - 0.25 * dropped)
    assert server.status()["round"] == final_round


def test_upload_failing_part_way_leaves_the_model_trainable_and_loses_nothing(setup) -> None:
    """Cut every attempt of an upload after the first tensor went out: the model must keep its
    local values, and the next sync must deliver all the steps, once."""
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        _on_every_attempt(proxy, Fault("up", 9000, prefix=b"POST /submit_pseudograd"))
        step(model, opt, 0.5)
        step(model, opt, 0.5)
        assert len(proxy.fired) == 4 and w.sync_metrics["failed_syncs"] == 1
        assert server.status()["round"] == 0
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), start[name] + 1.0)
        step(model, opt, 0.5)
        step(model, opt, 0.5)
        assert w.sync_metrics["rounds"] == 1
    assert server.status()["round"] == 1
    for name, t in server.global_params().items():
        torch.testing.assert_close(t, start[name] + 2.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), start[name] + 2.0)


def test_upload_counted_but_every_answer_lost_is_not_counted_twice(setup) -> None:
    """The server counts the first attempt and every reply is cut: the worker cannot know. Its
    next sync sends under the same id, learns it was a duplicate, and drops the steps it has
    taken since (they cannot be told apart from the counted ones) instead of counting the
    first ones a second time."""
    server, proxy = setup
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with _worker(proxy, model, opt) as w:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        replies = Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd")
        _on_every_attempt(proxy, replies)
        step(model, opt, 0.25)
        step(model, opt, 0.25)
        assert len(proxy.fired) == 4 and w.sync_metrics["failed_syncs"] == 1
        # Round 0 closed with the first attempt (+0.5); the worker still holds its local values.
        assert server.status()["round"] == 1
        step(model, opt, 0.25)
        step(model, opt, 0.25)
        m = w.sync_metrics
        assert m["rounds"] == 1 and m["dropped_steps"] == 2 and m["rebases"] == 0
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), start[name] + 0.5)
    st = server.status()
    # Only the first contribution ever counted; nothing was added twice (the exit sends nothing:
    # no steps since the last sync).
    assert st["round"] == 1
    for name, t in server.global_params().items():
        torch.testing.assert_close(t, start[name] + 0.5)
