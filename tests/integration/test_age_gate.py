"""The age gate (``--staleness-weighting age_gate --staleness-cutoff S``) through a real server on
loopback: an upload past the cutoff is acknowledged and changes nothing, not even the outer
optimizer's momentum; its retry is a duplicate; a younger one is applied with the cosine weight,
checked against arithmetic written out here; a worker told so counts its steps dropped."""

from __future__ import annotations

import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.http import (
    EXACT,
    accept,
    assert_params_equal,
    body,
    post_json,
    pseudo_grad,
    submit,
)
from tests.helpers.servers import ServerFactory
from tests.helpers.workers import fake_step, make_model, params_of

GATE = {"mode": "async", "num_workers": 3, "staleness_weighting": "age_gate"}


def join(server: DiLoCoServer, *workers: str) -> None:
    for w in workers:
        resp = post_json(server, "/register", {"worker_id": w})
        assert resp.status_code == 200, resp.text


def test_an_upload_past_the_cutoff_is_acknowledged_and_changes_nothing(
    make_server: ServerFactory,
) -> None:
    # Nesterov momentum 0.9: a gated upload must not move the momentum either, so the next
    # applied update equals the reference that never saw the gated one.
    server = make_server(staleness_cutoff=1, outer_lr=0.5, outer_momentum=0.9, **GATE)
    join(server, "a", "b", "c")
    old = server.global_params()
    accept(server, body("a", 0, "a-0", seed=1))  # version 1
    accept(server, body("a", 1, "a-1", seed=2))  # version 2
    before = server.global_params()
    # b trained from version 0: two updates old, past the cutoff of 1.
    gated = accept(server, body("b", 0, "b-0", seed=3))
    assert (gated["round"], gated["version"], gated["staleness"], gated["weight"]) == (1, 2, 2, 0)
    assert_params_equal(before, server.global_params())
    st = server.status()
    assert st["round"] == 2 and st["uploading"] == []
    assert st["staleness"]["gated"] == 1 and st["staleness"]["count"] == 3
    # Counted as received: its bytes and the worker's submission are on the record.
    assert {w["worker_id"]: w["submissions"] for w in st["workers"]}["b"] == 1
    assert st["staleness_weighting"] == "age_gate" and st["staleness_cutoff"] == 1
    assert len(st["update_log"]) == 2  # no update was made for it
    # A retry of the same id is a duplicate with the same answer, and still changes nothing.
    dup = submit(server, body("b", 0, "b-0", seed=3))
    assert dup.status_code == 200, dup.text
    assert (dup.json()["status"], dup.json()["round"], dup.json()["version"]) == ("duplicate", 1, 2)
    assert_params_equal(before, server.global_params())
    assert server.status()["staleness"]["gated"] == 1
    # c trained from version 1: one update old, weight (1 + cos(pi / 2)) / 2 = 0.5.
    applied = accept(server, body("c", 1, "c-1", seed=4))
    assert (applied["version"], applied["staleness"], applied["weight"]) == (3, 1, 0.5)
    lr, beta = 0.5, 0.9
    got = server.global_params()
    for name, p in old.items():
        m = torch.zeros_like(p)
        want = p.clone()
        for g in (pseudo_grad(1)[name], pseudo_grad(2)[name], 0.5 * pseudo_grad(4)[name]):
            m = beta * m + g
            want = want - lr * (g + beta * m)
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


def test_within_the_cutoff_every_age_is_applied_with_its_cosine_weight(
    make_server: ServerFactory,
) -> None:
    server = make_server(staleness_cutoff=3, **GATE, **EXACT)
    join(server, "a", "b", "c")
    old = server.global_params()
    accept(server, body("a", 0, "a-0", seed=1))
    accept(server, body("a", 1, "a-1", seed=2))
    reply = accept(server, body("b", 0, "b-0", seed=3))  # two updates old: cos(pi/2) -> 0.5
    assert (reply["staleness"], reply["weight"]) == (2, 0.5)
    got = server.global_params()
    for name, p in old.items():
        want = p - pseudo_grad(1)[name] - pseudo_grad(2)[name] - 0.5 * pseudo_grad(3)[name]
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


def test_a_gated_worker_counts_its_steps_dropped_and_adopts_the_current_version() -> None:
    cfg = ServerConfig(
        port=0,
        num_workers=2,
        mode="async",
        staleness_weighting="age_gate",
        staleness_cutoff=0,
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    init = params_of(make_model())
    with DiLoCoServer(cfg, initial_params=init) as srv:
        ma, mb = make_model(), make_model()
        oa, ob = torch.optim.SGD(ma.parameters(), lr=1.0), torch.optim.SGD(mb.parameters(), lr=1.0)
        kw = {"sync_every": 1, "heartbeat_interval": 0, "bf16_comm": False}
        wa = DiLoCoWorker(ma, oa, srv.address, worker_id="a", **kw).start()
        wb = DiLoCoWorker(mb, ob, srv.address, worker_id="b", **kw).start()
        fake_step(ma, oa, 1.0)  # fresh: applied, version 1
        fake_step(mb, ob, 5.0)  # from version 0, one update old, cutoff 0: gated
        st = srv.status()
        assert st["round"] == 1 and st["staleness"]["gated"] == 1
        assert (wa.sync_metrics["dropped_steps"], wb.sync_metrics["dropped_steps"]) == (0, 1)
        for name, t in params_of(mb).items():  # b holds version 1, its +5 nowhere
            torch.testing.assert_close(t, init[name] + 1.0)
            torch.testing.assert_close(srv.global_params()[name], init[name] + 1.0)
        fake_step(mb, ob, 2.0)  # now fresh: applied
        assert srv.status()["round"] == 2 and wb.sync_metrics["dropped_steps"] == 1
        wa.stop(submit=False)
        wb.stop(submit=False)
