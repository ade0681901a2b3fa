"""DiLoCoWorker against a real server: failures never escape optimizer.step(), progress is kept."""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.transport.client import Unreachable
from tests.helpers.workers import fake_step, make_model, params_of


def fast_client(address: str) -> DiLoCoClient:
    return DiLoCoClient(address, retries=1, backoff=0.01, connect_timeout=2, read_timeout=10)


def flaky_link_worker(
    model: torch.nn.Module, opt: torch.optim.Optimizer, address: str, sync_every: int
) -> DiLoCoWorker:
    """A started fp32 worker whose client gives up fast, for tests that take the server away."""
    return DiLoCoWorker(
        model,
        opt,
        address,
        sync_every=sync_every,
        heartbeat_interval=0,
        bf16_comm=False,
        client=fast_client(address),
    ).start()


@pytest.fixture
def server():
    srv = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    ).start()
    yield srv
    srv.stop()


def test_one_worker_with_plain_averaging_adopts_its_own_params(server: DiLoCoServer) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with DiLoCoWorker(
        model, opt, server.address, sync_every=2, heartbeat_interval=0, bf16_comm=False
    ) as w:
        start = params_of(model)
        fake_step(model, opt, 0.25)
        fake_step(model, opt, 0.25)  # sync: outer lr 1, no momentum => global = local
        assert w.sync_metrics["rounds"] == 1
    got = server.global_params()
    for name, t in start.items():
        torch.testing.assert_close(got[name], t + 0.5)
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), t + 0.5)


def test_a_counted_sync_adopts_the_download_as_it_lands(
    server: DiLoCoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an accepted upload the model takes the new values during the download (in
    slices), not in a pass over the model after it; the result is the same."""
    import diloco.worker.state.local_model as worker_mod

    decode_mod = importlib.import_module("diloco.wire.decode")  # the package exports decode()
    monkeypatch.setattr(decode_mod, "PROGRESS_BYTES", 8)  # report every two floats
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with DiLoCoWorker(
        model, opt, server.address, sync_every=2, heartbeat_interval=0, bf16_comm=False
    ) as w:
        start = params_of(model)
        passes: list[str] = []
        monkeypatch.setattr(worker_mod, "adopt_", lambda *a: passes.append("adopt"))
        monkeypatch.setattr(worker_mod, "rebase_", lambda *a: passes.append("rebase"))
        fake_step(model, opt, 0.25)
        fake_step(model, opt, 0.25)
        assert w.sync_metrics["rounds"] == 1 and w._local.adopted
        assert passes == []  # no pass over the model after the download
        got = server.global_params()
        for name, t in start.items():
            torch.testing.assert_close(got[name], t + 0.5)
            assert torch.equal(dict(model.named_parameters())[name].detach(), got[name])


def test_unreachable_server_never_escapes_optimizer_step(server: DiLoCoServer) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    worker = flaky_link_worker(model, opt, server.address, sync_every=2)
    start = params_of(model)
    server.stop()
    for _ in range(4):
        fake_step(model, opt, 0.125)  # two syncs fail inside step(); nothing is raised
    m = worker.sync_metrics
    assert m["failed_syncs"] == 2
    assert m["retries"] >= 2
    assert m["rounds"] == 0
    # Local progress is intact: four steps of +0.125 on top of the start.
    for name, t in params_of(model).items():
        torch.testing.assert_close(t, start[name] + 0.5)
    worker.stop()  # leaving an unreachable server logs and returns


def test_restarted_server_unknown_worker_rejoins_and_rebases(server: DiLoCoServer) -> None:
    port = server.port
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    worker = flaky_link_worker(model, opt, server.address, sync_every=3)
    start = params_of(model)
    fake_step(model, opt, 0.5)
    fake_step(model, opt, 0.5)
    server.stop()
    # A new server with other parameters comes up on the same port and does not know the worker.
    new_global = {n: torch.full_like(t, 10.0) for n, t in start.items()}
    with DiLoCoServer(
        ServerConfig(port=port, num_workers=1, outer_lr=1.0, outer_momentum=0.0),
        initial_params=new_global,
    ):
        fake_step(model, opt, 0.5)  # sync: 410 -> register -> rebase onto the new parameters
        m = worker.sync_metrics
        assert m["reconnections"] == 1 and m["rebases"] == 1 and m["failed_syncs"] == 0
        # Progress (3 steps of +0.5) kept on top of the new global parameters, not replaced.
        for name, t in params_of(model).items():
            torch.testing.assert_close(t, new_global[name] + 1.5)
        worker.stop()


def test_late_joiner_is_refused_then_takes_part_next_round() -> None:
    cfg = ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    with DiLoCoServer(cfg, initial_params=params_of(make_model())) as srv:
        first_model, second_model = make_model(), make_model()
        o1 = torch.optim.SGD(first_model.parameters(), lr=1.0)
        o2 = torch.optim.SGD(second_model.parameters(), lr=1.0)
        kw = {"sync_every": 2, "heartbeat_interval": 0, "bf16_comm": False}
        w1 = DiLoCoWorker(first_model, o1, srv.address, worker_id="a", **kw).start()
        # Round 0 opened with {a}; b joins after it opened.
        w2 = DiLoCoWorker(second_model, o2, srv.address, worker_id="b", **kw).start()
        assert srv.status()["expected"] == ["a"]
        fake_step(second_model, o2, 1.0)
        fake_step(second_model, o2, 1.0)  # b submits to round 0: not expected, keeps training
        assert w2.sync_metrics["refused_submissions"] == 1
        assert srv.status()["submitted"] == []
        fake_step(first_model, o1, 0.25)
        fake_step(first_model, o1, 0.25)  # a closes round 0 alone
        status = srv.status()
        assert status["round"] == 1 and sorted(status["expected"]) == ["a", "b"]
        done = threading.Event()

        def b_round() -> None:
            fake_step(second_model, o2, 1.0)
            fake_step(second_model, o2, 1.0)  # stale (base 0): rebases onto round 1, keeps 4 steps
            done.set()

        t = threading.Thread(target=b_round)
        t.start()
        t.join(30)
        assert done.is_set()
        assert w2.sync_metrics["rebases"] == 1
        g1 = srv.global_params()
        for name, t0 in params_of(second_model).items():
            torch.testing.assert_close(t0, g1[name] + 4.0)
        w1.stop(submit=False)
        w2.stop(submit=False)


def test_model_that_does_not_match_the_server_is_a_clear_error(server: DiLoCoServer) -> None:
    model = make_model()
    with DiLoCoWorker(
        model, torch.optim.SGD(model.parameters(), lr=0.1), server.address, heartbeat_interval=0
    ):
        pass
    other = torch.nn.Linear(3, 5)
    with pytest.raises(ValueError, match="does not match the server"):
        DiLoCoWorker(
            other, torch.optim.SGD(other.parameters(), lr=0.1), server.address, heartbeat_interval=0
        ).start()


def test_exit_sends_remaining_steps_then_deregisters(server: DiLoCoServer) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    start = params_of(model)
    with DiLoCoWorker(
        model, opt, server.address, sync_every=100, heartbeat_interval=0, bf16_comm=False
    ):
        fake_step(model, opt, 0.5)
    # The round closes in the server's background right after the upload is counted.
    deadline = time.monotonic() + 10
    while server.status()["round"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    status = server.status()
    assert status["workers"] == [] and status["round"] == 1
    for name, t in server.global_params().items():
        torch.testing.assert_close(t, start[name] + 0.5)


def test_env_variables_are_defaults_and_unknown_ones_are_errors(
    server: DiLoCoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model()
    monkeypatch.setenv("DILOCO_SERVER", server.address)
    monkeypatch.setenv("DILOCO_SYNC_EVERY", "7")
    monkeypatch.setenv("DILOCO_BF16_COMM", "0")
    w = DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), heartbeat_interval=0)
    assert (
        w.sync_every == 7
        and w.settings.bf16_comm is False
        and w.settings.server_addr == server.address
    )
    monkeypatch.setenv("DILOCO_SYNC_EVRY", "7")
    with pytest.raises(ValueError, match="unknown environment variable DILOCO_SYNC_EVRY"):
        DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_barrier_wait_gives_up_keeping_its_progress_and_never_counts_twice() -> None:
    """A worker that gives up waiting keeps its counted progress (the server holds it only in
    memory until the round closes) and hands it in again under the same id; the server says
    "duplicate", and the steps mixed in since are dropped and counted as such."""
    cfg = ServerConfig(port=0, num_workers=2, outer_lr=1.0, outer_momentum=0.0, poll_timeout=0.1)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        ma, mb = make_model(), make_model()
        oa, ob = torch.optim.SGD(ma.parameters(), lr=1.0), torch.optim.SGD(mb.parameters(), lr=1.0)
        kw = {"sync_every": 1, "heartbeat_interval": 0, "bf16_comm": False, "max_barrier_wait": 0.3}
        wa = DiLoCoWorker(ma, oa, srv.address, worker_id="a", **kw).start()
        wb = DiLoCoWorker(mb, ob, srv.address, worker_id="b", **kw).start()
        fake_step(ma, oa, 1.0)  # a submits +1 and gives up waiting for b
        assert wa.sync_metrics["rounds"] == 0 and srv.status()["submitted"] == ["a"]
        for name, t in params_of(ma).items():  # its counted progress stays until round 1 comes
            torch.testing.assert_close(t, init[name] + 1.0)
        fake_step(mb, ob, 3.0)  # b closes round 0: global = init + mean(+1, +3) = init + 2
        g1 = srv.global_params()
        for name in init:
            torch.testing.assert_close(g1[name], init[name] + 2.0)
        fake_step(ma, oa, 0.5)  # a resends its upload's id: a duplicate; its +0.5 is dropped
        for name, t in params_of(ma).items():
            torch.testing.assert_close(t, g1[name])
        assert wa.sync_metrics["dropped_steps"] == 1 and wa.sync_metrics["rounds"] == 1
        assert srv.status()["round"] == 1  # the resent body was not counted a second time
        wa.stop(submit=False)
        wb.stop(submit=False)


@pytest.mark.parametrize("second", ["counted", "kept"])
def test_a_refresh_drops_counted_progress_and_rebases_kept_progress(second: str) -> None:
    """The model is turned into progress only when that progress is to be kept; progress once
    counted by the server is never added back, whatever the next refresh is asked to do."""
    model = torch.nn.Linear(2, 1, bias=False)
    worker = DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), "127.0.0.1:9")
    new_global = torch.tensor([[10.0, 20.0]])
    calls: list[int] = []

    def download(min_round: int, deadline: float | None = None, *, adopt: bool = False) -> bool:
        calls.append(min_round)  # fills the snapshot only: the refresh then adopts it whole
        if len(calls) == 1:
            raise Unreachable("cut off inside the payload")  # the snapshot is half-written
        worker._local.snapshot["weight"].copy_(new_global)
        return True

    worker._local.snapshot = {"weight": torch.tensor([[1.0, 1.0]])}
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 5.0]]))  # progress (2, 4) on top of the snapshot
    worker._session.fetch = download  # type: ignore[method-assign]
    worker._local.snapshot_dirty = True
    with pytest.raises(Unreachable):
        worker._session.refresh(counted=True, min_round=1)
    assert worker._local.holds_progress and worker._local.progress_counted
    # A counted upload's steps are the server's now: asking to keep them must not add them back.
    worker._session.refresh(counted=second == "counted", min_round=1)
    assert torch.equal(model.weight.detach(), new_global)
    assert not worker._local.holds_progress

    # Progress that was not counted is kept on top of the new parameters (a rebase).
    worker._local.snapshot["weight"].copy_(torch.tensor([[1.0, 1.0]]))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 5.0]]))
    worker._session.refresh(counted=False, min_round=2)
    assert torch.equal(model.weight.detach(), new_global + torch.tensor([[2.0, 4.0]]))


def test_steps_in_a_round_the_server_refused_are_counted_dropped() -> None:
    """Two finite uploads whose sum overflows fp32: the server refuses the round (parameters
    unchanged) and says so in later upload replies; each worker counts its steps in it as
    dropped, and steps in rounds that went through are not."""
    cfg = ServerConfig(port=0, num_workers=2, outer_lr=1.0, outer_momentum=0.0)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        models = [make_model(), make_model()]
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
        kw = {"sync_every": 1, "heartbeat_interval": 0, "bf16_comm": False}
        workers = [
            DiLoCoWorker(m, o, srv.address, worker_id=f"w{i}", **kw).start()
            for i, (m, o) in enumerate(zip(models, opts, strict=True))
        ]

        def both(delta: float) -> None:
            threads = [
                threading.Thread(target=fake_step, args=(m, o, delta))
                for m, o in zip(models, opts, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)

        both(3e38)  # round 0: -3e38 twice overflows fp32; refused, parameters unchanged
        assert srv.status()["refused_updates"] == 1
        for name, t in srv.global_params().items():
            torch.testing.assert_close(t, init[name])
        assert [w.sync_metrics["dropped_steps"] for w in workers] == [0, 0]
        both(0.5)  # round 1 goes through; its replies name round 0 as refused
        assert [w.sync_metrics["dropped_steps"] for w in workers] == [1, 1]
        both(0.5)  # named again: not counted twice, and round 1's steps were not dropped
        assert [w.sync_metrics["dropped_steps"] for w in workers] == [1, 1]
        for name, t in srv.global_params().items():
            torch.testing.assert_close(t, init[name] + 1.0)
        for w in workers:
            w.stop(submit=False)


def test_steps_of_a_refused_async_update_are_counted_dropped() -> None:
    cfg = ServerConfig(port=0, num_workers=2, mode="async", outer_lr=1.0, outer_momentum=0.0)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        ma, mb = make_model(), make_model()
        oa, ob = torch.optim.SGD(ma.parameters(), lr=1.0), torch.optim.SGD(mb.parameters(), lr=1.0)
        kw = {"sync_every": 1, "heartbeat_interval": 0, "bf16_comm": False}
        wa = DiLoCoWorker(ma, oa, srv.address, worker_id="a", **kw).start()
        wb = DiLoCoWorker(mb, ob, srv.address, worker_id="b", **kw).start()
        fake_step(ma, oa, 3e38)  # applied: the parameters move by 3e38
        fake_step(mb, ob, 3e38)  # from the old version: another 3e38 would overflow; refused
        assert srv.status()["refused_updates"] == 1
        assert (wa.sync_metrics["dropped_steps"], wb.sync_metrics["dropped_steps"]) == (0, 1)
        for name, t in params_of(mb).items():  # b holds the served values, a's update in them
            torch.testing.assert_close(t, srv.global_params()[name])
            torch.testing.assert_close(t, init[name] + 3e38)
        wa.stop(submit=False)
        wb.stop(submit=False)


def test_exit_after_a_wait_gave_up_resends_the_held_upload_and_counts_what_it_drops() -> None:
    cfg = ServerConfig(port=0, num_workers=2, outer_lr=1.0, outer_momentum=0.0, poll_timeout=0.1)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        ma, mb = make_model(), make_model()
        oa = torch.optim.SGD(ma.parameters(), lr=1.0)
        kw = {"heartbeat_interval": 0, "bf16_comm": False, "max_barrier_wait": 0.3}
        wa = DiLoCoWorker(ma, oa, srv.address, worker_id="a", sync_every=2, **kw).start()
        wb = DiLoCoWorker(mb, torch.optim.SGD(mb.parameters(), lr=1.0), srv.address, **kw)
        wb.start()
        fake_step(ma, oa, 1.0)
        fake_step(ma, oa, 1.0)  # a's upload (+2) is accepted; b never sends: a gives up
        fake_step(ma, oa, 0.5)
        wa.stop()  # the final upload goes under the held id: a duplicate, its +0.5 dropped
        assert wa.sync_metrics["dropped_steps"] == 1
        assert srv.status()["submitted"] == ["a"]  # counted once
        wb.stop(submit=False)  # round 0 closes with a's +2 only
        _, got = DiLoCoClient(srv.address).get_global_params(min_round=1)  # waits for the close
        for name, t in got.items():
            torch.testing.assert_close(t, init[name] + 2.0)
