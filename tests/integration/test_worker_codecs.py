"""Compressed uploads with error feedback, worker side, through a real server (issue 18).

A ``CaptureClient`` keeps every upload body the worker streams, with the true pseudo-gradient
``snapshot - local`` at that moment and the server's answer, so the tests check the worker's own
code path: what a body holds (a safetensors file naming its codec), and the error-feedback
invariant ``sum of decoded counted bodies + residual == sum of true pseudo-gradients``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker import resume
from tests.helpers.capture import CaptureClient, Captured
from tests.helpers.faultproxy import Fault, FaultProxy
from tests.helpers.threads import in_threads

CONTINUE = len(b"HTTP/1.1 100 Continue\r\n\r\n")  # an upload's interim answer

TOPK = "topk:density=0.1,chunk=64,bits=4"
LOSSY = ["int8", "int4", "lowrank", TOPK]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def random_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad()


def capturing_worker(address: str, codec: str, **kw: Any) -> tuple[DiLoCoWorker, CaptureClient]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    client = CaptureClient(address)
    worker = DiLoCoWorker(
        model, opt, address, heartbeat_interval=0, codec=codec, client=client, **kw
    )
    client.worker = worker
    return worker, client


def residuals(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    fb = worker._encoder.feedback
    assert fb is not None
    return {n: e.clone() for n, e in fb.residuals.items()}


def assert_invariant(worker: DiLoCoWorker, uploads: list[Captured]) -> None:
    """Plain mode: decoded counted bodies plus the residual sum to the true pseudo-gradients."""
    shapes = worker._local.table()
    sent = {n: torch.zeros(s) for n, s in shapes.items()}
    true = {n: torch.zeros(s) for n, s in shapes.items()}
    for up in uploads:
        if up.counted:
            for n, t in up.decoded(shapes).items():
                sent[n] += t
                true[n] += up.true[n]
    for n, e in residuals(worker).items():
        sent[n] += e
    for n in shapes:
        torch.testing.assert_close(sent[n], true[n], rtol=1e-5, atol=1e-5)


@pytest.fixture
def server():
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as srv:
        yield srv


@pytest.mark.parametrize("codec", [*LOSSY, "bf16", "fp32"])
def test_a_captured_body_opens_with_safetensors_and_names_its_codec(
    server: DiLoCoServer, codec: str
) -> None:
    worker, client = capturing_worker(server.address, codec, sync_every=2)
    gen = torch.Generator().manual_seed(1)
    with worker:
        for _ in range(2):
            random_step(worker.model, worker.optimizer, gen)
    (up,) = [u for u in client.uploads if u.counted][:1]
    name = codec.partition(":")[0]
    assert up.metadata["codec"] == name and up.metadata["codec"] == worker.codec_name
    tensors = safetensors.torch.load(up.body)
    params = list(worker._local.params)
    expected = [n + p.suffix for n in params for p in worker.codec.parts(worker._local.table()[n])]
    assert sorted(tensors) == sorted(expected)
    if codec in ("bf16", "fp32"):  # today's body: the pseudo-gradients themselves
        dtype = torch.bfloat16 if codec == "bf16" else torch.float32
        assert all(t.dtype == dtype for t in tensors.values())
        assert worker.sync_metrics["residual_norm"] == 0.0
    else:  # each parameter's parts together, scales and factors first
        assert up.names == expected
        assert worker.sync_metrics["residual_norm"] > 0


@pytest.mark.parametrize("codec", LOSSY)
def test_sent_plus_residual_is_the_sum_of_the_true_pseudo_gradients(
    server: DiLoCoServer, codec: str
) -> None:
    worker, client = capturing_worker(server.address, codec, sync_every=3)
    gen = torch.Generator().manual_seed(2)
    with worker:
        for _ in range(12):  # four syncs
            random_step(worker.model, worker.optimizer, gen)
        assert len(client.uploads) == 4 and all(u.counted for u in client.uploads)
        assert_invariant(worker, client.uploads)
        m = worker.sync_metrics
        norm = sum(float(e.square().sum()) for e in residuals(worker).values()) ** 0.5
        assert m["residual_norm"] == pytest.approx(norm, rel=1e-5)
        assert m["last_bytes_up"] == len(client.uploads[-1].body)
        assert m["last_bytes_down"] > 0


def test_a_refused_upload_leaves_the_residual_and_a_rebase_keeps_it(server: DiLoCoServer) -> None:
    """A server restart: the upload gets a 410, the worker re-joins and rebases; the residual
    is what the last counted upload left, and the invariant holds over the counted uploads."""
    port = server.port
    worker, client = capturing_worker(server.address, "int8", sync_every=2)
    gen = torch.Generator().manual_seed(3)
    worker.start()
    for _ in range(2):
        random_step(worker.model, worker.optimizer, gen)
    before = residuals(worker)
    server.stop()
    other = {n: torch.zeros_like(p) for n, p in make_model().named_parameters()}
    with DiLoCoServer(ServerConfig(port=port, num_workers=1), initial_params=other):
        for _ in range(2):  # 410 -> re-join -> rebase; nothing counted
            random_step(worker.model, worker.optimizer, gen)
        m = worker.sync_metrics
        assert m["reconnections"] == 1 and m["rebases"] == 1
        after = residuals(worker)
        assert all(torch.equal(after[n], before[n]) for n in before)
        for _ in range(2):
            random_step(worker.model, worker.optimizer, gen)
        worker.stop(submit=False)
    assert [u.counted for u in client.uploads] == [True, False, True]
    assert_invariant(worker, client.uploads)


@pytest.mark.parametrize("codec", ["int8", TOPK])
def test_streaming_fragments_keep_the_invariant_per_piece(codec: str) -> None:
    cfg = ServerConfig(port=0, num_workers=1, num_fragments=2)
    with DiLoCoServer(cfg) as srv:
        worker, client = capturing_worker(srv.address, codec, sync_every=4, num_fragments=2)
        gen = torch.Generator().manual_seed(4)
        with worker:
            for _ in range(12):
                random_step(worker.model, worker.optimizer, gen)
            assert worker._strategy._inflight is None  # type: ignore[attr-defined]  # tau = 0
            plan = {p.wire_name: p for frag in worker._strategy.plan for p in frag}  # type: ignore[attr-defined]
            shapes = worker._local.table()
            sent = {n: torch.zeros(s).view(-1) for n, s in shapes.items()}
            true = {n: torch.zeros(s).view(-1) for n, s in shapes.items()}
            counted = [u for u in client.uploads if u.counted]
            assert len(counted) == 6 and {u.fragment for u in counted} == {0, 1}
            for up in counted:
                pieces = {w: (plan[w].numel,) for w in up.true}
                for w, t in up.decoded(pieces).items():
                    sent[plan[w].param][plan[w].start : plan[w].stop] += t
                    true[plan[w].param][plan[w].start : plan[w].stop] += up.true[w]
            for n, e in residuals(worker).items():
                sent[n] += e.view(-1)
            for n in shapes:
                torch.testing.assert_close(sent[n], true[n], rtol=1e-5, atol=1e-5)
            assert worker.sync_metrics["residual_norm"] > 0


@pytest.mark.parametrize("codec", ["int8", "lowrank"])
def test_resume_restores_the_residual_and_the_codec_state(
    server: DiLoCoServer, codec: str, tmp_path: Path
) -> None:
    worker, _ = capturing_worker(server.address, codec, sync_every=2, worker_id="w")
    gen = torch.Generator().manual_seed(5)
    worker.start()
    for _ in range(5):
        random_step(worker.model, worker.optimizer, gen)
    resume.save(worker, str(tmp_path))
    saved_e, saved_q = residuals(worker), worker.codec.state_dict()
    assert (tmp_path / resume.CODEC_FILE).is_file()
    assert bool(saved_q) == (codec == "lowrank")
    worker.stop(submit=False)

    again, _ = capturing_worker(server.address, codec, sync_every=2, worker_id="w")
    loaded = resume.load(str(tmp_path))
    assert loaded is not None
    resume.start_resumed(again, *loaded, resume.load_codec_state(str(tmp_path)))
    got_e, got_q = residuals(again), again.codec.state_dict()
    assert sorted(got_e) == sorted(saved_e) and sorted(got_q) == sorted(saved_q)
    assert all(torch.equal(got_e[n], saved_e[n]) for n in saved_e)
    assert all(torch.equal(got_q[n], saved_q[n]) for n in saved_q)
    assert again.sync_metrics["residual_norm"] == pytest.approx(
        sum(float(e.square().sum()) for e in saved_e.values()) ** 0.5, rel=1e-5
    )
    again.stop(submit=False)


def test_a_codec_the_server_refuses_fails_at_start() -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, codecs="fp32,bf16")) as srv:
        worker, _ = capturing_worker(srv.address, "int4", sync_every=2)
        with pytest.raises(ValueError, match="refuses codec.*int4"):
            worker.start()
        assert srv.status()["workers"] == []  # refused at registration: nothing to undo


# --- two workers through a real server: they train, and end near the bf16 run ----------------


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(100 + rank))
    return x, torch.tanh(x @ teacher)


def _train(codec: str, rounds: int = 6, every: int = 5) -> tuple[dict[str, torch.Tensor], float]:
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    with DiLoCoServer(ServerConfig(port=0, num_workers=2), initial_params=init) as srv:

        def run(rank: int) -> None:
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            x, y = _data(rank)
            with DiLoCoWorker(
                model, opt, srv.address, sync_every=every, heartbeat_interval=0, codec=codec
            ) as w:
                for step in range(rounds * every):
                    i = (step * 32) % 256
                    loss = torch.nn.functional.mse_loss(model(x[i : i + 32]), y[i : i + 32])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    w.report(samples=32)
                assert w.sync_metrics["failed_syncs"] == 0

        in_threads(2, run, timeout=60)
        params = srv.global_params()
    model = make_model()
    model.load_state_dict(params)
    with torch.no_grad():
        loss = sum(float(torch.nn.functional.mse_loss(model(x), y)) for x, y in map(_data, (0, 1)))
    return params, loss / 2


@pytest.mark.timeout(120)
def test_compressed_uploads_train_close_to_bf16() -> None:
    ref, ref_loss = _train("bf16")
    bounds = {"int8": 0.02, "int4": 0.15, "lowrank": 0.5}  # relative parameter distance
    for codec, bound in bounds.items():
        got, loss = _train(codec)
        assert all(bool(torch.isfinite(t).all()) for t in got.values()), codec
        rel = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
        assert rel < bound, (codec, rel)
        assert loss < 1.25 * ref_loss, (codec, loss, ref_loss)


@pytest.mark.parametrize(
    "fault",
    [
        Fault("up", 600, prefix=b"POST /submit_pseudograd"),
        Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd"),
    ],
    ids=["body cut, retried", "counted, answer lost, retried: duplicate"],
)
def test_a_retried_upload_sends_the_same_body_and_moves_the_residual_once(fault: Fault) -> None:
    """Within one sync a retry encodes the same ``g + e`` into the same bytes; the residual
    moves once, so the server's sum and the residual still add up to the true progress."""
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    cfg = ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    with DiLoCoServer(cfg, initial_params=init) as srv:
        proxy = FaultProxy(srv.port)
        try:
            worker, client = capturing_worker(proxy.address, "int4", sync_every=2)
            gen = torch.Generator().manual_seed(6)
            with worker:
                proxy.add(fault)
                for _ in range(6):
                    random_step(worker.model, worker.optimizer, gen)
                assert proxy.fired and worker.sync_metrics["retries"] >= 1
                assert worker.sync_metrics["rounds"] == 3
                for up in client.uploads:  # a duplicate here answers a retry of this very body
                    assert up.reply is not None and up.reply["status"] in ("accepted", "duplicate")
                    up.reply = {**up.reply, "status": "accepted"}
                assert_invariant(worker, client.uploads)
                shapes = worker._local.table()
                total = {n: sum(u.decoded(shapes)[n] for u in client.uploads) for n in shapes}
                for n, t in srv.global_params().items():  # outer lr 1: global = init - sum
                    torch.testing.assert_close(t, init[n] - total[n])
        finally:
            proxy.close()


# --- async mode: two workers at different speeds --------------------------------------------


@pytest.mark.parametrize("codec", ["int8", TOPK])
def test_async_workers_at_different_speeds_keep_the_invariant_and_move_the_model(
    codec: str,
) -> None:
    """An async server, two workers syncing every 2 and every 3 steps (so their uploads
    interleave and arrive stale): every upload is accepted and applied as the next version
    (the server's parameters are the outer Nesterov step replayed on the decoded uploads in
    the order the server applied them), the parameters are finite and moved, and each worker's
    sent plus residual is the sum of its true pseudo-gradients."""
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    cfg = ServerConfig(port=0, num_workers=2, mode="async")
    with DiLoCoServer(cfg, initial_params=init) as srv:
        pairs = [capturing_worker(srv.address, codec, sync_every=2 + i) for i in range(2)]

        def run(i: int) -> None:
            worker, _ = pairs[i]
            gen = torch.Generator().manual_seed(20 + i)
            with worker:
                for _ in range(12):
                    random_step(worker.model, worker.optimizer, gen)

        in_threads(2, run, timeout=60)
        got, status = srv.global_params(), srv.status()
    shapes = pairs[0][0]._local.table()
    applied: list[tuple[int, Captured]] = []
    for worker, client in pairs:
        assert client.uploads and all(u.counted for u in client.uploads)
        assert_invariant(worker, client.uploads)
        assert worker.sync_metrics["residual_norm"] > 0
        applied += [(int(u.reply["round"]), u) for u in client.uploads if u.reply is not None]
    assert [len(c.uploads) for _, c in pairs] == [6, 4]  # 12 steps / 2, 12 / 3: the final ones
    assert sorted(r for r, _ in applied) == list(range(10))  # each one version, none lost
    assert status["round"] == 10
    model = {n: t.clone().requires_grad_() for n, t in init.items()}
    outer = torch.optim.SGD(model.values(), lr=cfg.outer_lr, momentum=0.9, nesterov=True)
    for _, up in sorted(applied, key=lambda x: x[0]):
        for n, t in up.decoded(shapes).items():
            model[n].grad = t
        outer.step()
    for n, t in got.items():
        assert bool(torch.isfinite(t).all()) and not torch.equal(t, init[n]), n
        torch.testing.assert_close(t, model[n].detach(), rtol=1e-5, atol=1e-5)
