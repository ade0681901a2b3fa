"""``--weighting tokens`` through a real server on loopback: each upload weighs the tokens it
says it represents (checked against the weighted mean written out here), an upload without a
token count or with a malformed one is refused and changes nothing, and a worker whose loop
reports tokens syncs with them while one that reports none stops with a clear error."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.wire import encode
from diloco.worker import resume
from tests.helpers.http import (
    EXACT,
    accept,
    assert_error,
    assert_unchanged,
    post_json,
    pseudo_grad,
    state,
    submit,
    wait_round,
)
from tests.helpers.servers import ServerFactory
from tests.helpers.workers import fake_step, make_model, params_of

TOKENS = {"num_workers": 2, "weighting": "tokens"}


def upload(worker: str, sid: str, seed: int, **extra: str) -> bytes:
    meta = {"worker_id": worker, "base_round": "0", "submission_id": sid, **extra}
    return encode(pseudo_grad(seed), meta)


def join(server: DiLoCoServer, *workers: str) -> None:
    for w in workers:
        resp = post_json(server, "/register", {"worker_id": w})
        assert resp.status_code == 200, resp.text
        assert resp.json()["weighting"] == "tokens"  # the worker learns it when it joins


def test_the_round_is_the_token_weighted_mean(make_server: ServerFactory) -> None:
    server = make_server(**TOKENS, **EXACT)
    join(server, "a", "b")
    old = server.global_params()
    # b's samples' weight is ignored: only the tokens count.
    accept(server, upload("a", "a-0", 1, tokens="1000", weight="9"))
    accept(server, upload("b", "b-0", 2, tokens="3000", weight="1"))
    wait_round(server, 1)
    ga, gb = pseudo_grad(1), pseudo_grad(2)
    got = server.global_params()
    for name, p in old.items():
        want = p - (1000 * ga[name] + 3000 * gb[name]) / 4000
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({}, "missing_metadata"),
        ({"weight": "5"}, "missing_metadata"),
        ({"tokens": "many"}, "bad_metadata"),
        ({"tokens": "nan"}, "bad_metadata"),
        ({"tokens": "0"}, "bad_metadata"),
        ({"tokens": "-3"}, "bad_metadata"),
        ({"tokens": "1e13"}, "bad_metadata"),
    ],
)
def test_an_upload_without_a_sound_token_count_is_refused_and_changes_nothing(
    make_server: ServerFactory, extra: dict[str, str], code: str
) -> None:
    server = make_server(**TOKENS, **EXACT)
    join(server, "a", "b")
    accept(server, upload("a", "a-0", 1, tokens="100"))
    before = state(server)
    reply = assert_error(submit(server, upload("b", "b-0", 2, **extra)), 400, code)
    assert "tokens" in reply["detail"]
    assert_unchanged(before, server)
    accept(server, upload("b", "b-0", 2, tokens="300"))  # the same id, now sound: counted
    wait_round(server, 1)


def _workers(
    srv: DiLoCoServer,
) -> tuple[list[torch.nn.Module], list[torch.optim.SGD], list[DiLoCoWorker]]:
    models = [make_model(), make_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
    kw = {"sync_every": 1, "heartbeat_interval": 0, "bf16_comm": False}
    workers = [
        DiLoCoWorker(m, o, srv.address, worker_id=f"w{i}", **kw).start()
        for i, (m, o) in enumerate(zip(models, opts, strict=True))
    ]
    return models, opts, workers


def test_workers_that_report_tokens_are_weighted_by_them() -> None:
    cfg = ServerConfig(port=0, outer_lr=1.0, outer_momentum=0.0, **TOKENS)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        models, opts, workers = _workers(srv)
        workers[0].report(tokens=100, samples=50)  # samples do not weigh under tokens
        workers[1].report(tokens=300, samples=1)
        # w0 submits +1 and w1 +5 (a local step moves each by its delta); each waits for the
        # round, which closes once both are in.
        steps = [
            threading.Thread(target=fake_step, args=(m, o, d))
            for m, o, d in zip(models, opts, (1.0, 5.0), strict=True)
        ]
        for t in steps:
            t.start()
        for t in steps:
            t.join(30)
        assert srv.status()["round"] == 1
        for name, t in srv.global_params().items():  # (100 * 1 + 300 * 5) / 400 = 4
            torch.testing.assert_close(t, init[name] + 4.0)
        for w in workers:
            w.stop(submit=False)


def test_a_worker_that_reports_no_tokens_stops_with_a_clear_error() -> None:
    cfg = ServerConfig(port=0, outer_lr=1.0, outer_momentum=0.0, **TOKENS)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        models, opts, workers = _workers(srv)
        with pytest.raises(RuntimeError, match=r"weights uploads by tokens.*report\(tokens=n\)"):
            fake_step(models[0], opts[0], 1.0)
        with pytest.raises(ValueError, match="tokens must be a finite number >= 0"):
            workers[1].report(tokens=float("nan"))
        assert srv.status()["round"] == 0 and srv.status()["submitted"] == []
        for w in workers:
            w.stop(submit=False)


def test_the_tokens_since_the_last_sync_survive_a_worker_checkpoint(tmp_path: Path) -> None:
    """Reported, not yet sent, checkpointed: the resumed worker's next upload weighs them."""
    cfg = ServerConfig(port=0, outer_lr=1.0, outer_momentum=0.0, **TOKENS)
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        kw = {"sync_every": 2, "heartbeat_interval": 0, "bf16_comm": False}
        m0, m1 = make_model(), make_model()
        o0, o1 = torch.optim.SGD(m0.parameters(), lr=1.0), torch.optim.SGD(m1.parameters(), lr=1.0)
        w0 = DiLoCoWorker(m0, o0, srv.address, worker_id="w0", **kw).start()
        w0.report(tokens=100)
        fake_step(m0, o0, 1.0)  # one step of two: nothing sent yet
        assert resume.save(w0, str(tmp_path)).tokens == 100.0
        w0.stop(submit=False)
        # An older state file, without the count, reads as none counted.
        raw = json.loads((tmp_path / resume.STATE_FILE).read_text())
        assert resume.WorkerState(**{k: v for k, v in raw.items() if k != "tokens"}).tokens == 0.0
        again = DiLoCoWorker(m0, o0, srv.address, **kw)
        loaded = resume.load(str(tmp_path))
        assert loaded is not None
        resume.start_resumed(again, *loaded)
        w1 = DiLoCoWorker(m1, o1, srv.address, worker_id="w1", **kw).start()
        again.report(tokens=200)  # 300 in all for w0's upload of +2
        w1.report(tokens=100)
        w1.report(tokens=200)  # 300 for w1's upload of +8

        def two_steps() -> None:
            fake_step(m1, o1, 4.0)
            fake_step(m1, o1, 4.0)

        threads = [
            threading.Thread(target=fake_step, args=(m0, o0, 1.0)),
            threading.Thread(target=two_steps),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        for name, value in srv.global_params().items():  # (300 * 2 + 300 * 8) / 600 = 5
            torch.testing.assert_close(value, init[name] + 5.0)
        again.stop(submit=False)
        w1.stop(submit=False)
