"""A relay that dies at the exact moments that matter and comes back from its save dir
(``--save-every 1``): after its round closed on its worker's acknowledged upload but before its
upload upstream, and after the upstream counted that upload but before the relay published the
result. The relay is stopped in-process at a hook in its upstream link, with nothing saved on
the way out, as a kill -9 would leave it; a new relay then starts on the same port from the
same save dir.

The ledger (as ``tests/helpers/crash_scenario.py``'s): the worker's inner SGD (lr 1) on a
constant gradient moves every element by ``-G`` per step, the relay forwards its one worker's
pseudo-gradient and the upstream steps plain SGD (lr 1, no momentum), so the upstream's
parameters must end at ``init - (steps - dropped) * G``: an upload counted twice upstream, or
lost, shows up as a multiple of ``G``."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.server.relay.upstream import RelayStopped
from tests.helpers.relays import upstream_of

G = 0.125
SYNC_EVERY = 3
STEPS = 15  # five rounds
KILL_ROUND = 2  # the relay round at whose close the relay dies


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", ["upload", "counted"])
def test_a_relay_killed_between_its_workers_ack_and_its_result_counts_the_upload_once(
    tmp_path: Path, moment: str
) -> None:
    upstream = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    ).start()
    relay_config = ServerConfig(
        port=0,
        num_workers=1,
        upstream=upstream.address,
        upstream_codec="fp32",
        save_dir=str(tmp_path / "relay"),
        save_every=1,
        poll_timeout=2.0,
    )
    relay = DiLoCoServer(relay_config).start()
    port = relay.port
    hit, release = threading.Event(), threading.Event()

    def die(at: str, sid: str) -> None:
        # ``<relay id>:<relay round>:<upstream base>``: the relay's round is the second part.
        if at == moment and sid.split(":")[1] == str(KILL_ROUND) and not hit.is_set():
            hit.set()
            release.wait(30)
            raise RelayStopped("killed")

    upstream_of(relay).at = die
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    client = DiLoCoClient(relay.address, retries=40, backoff=0.05, max_backoff=0.5, read_timeout=30)
    worker = DiLoCoWorker(
        model,
        opt,
        relay.address,
        sync_every=SYNC_EVERY,
        bf16_comm=False,
        worker_id="w",
        heartbeat_interval=0,
        client=client,
    )
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with worker:
                for _ in range(STEPS):
                    for p in model.parameters():
                        p.grad = torch.full_like(p, G)
                    opt.step()
                    opt.zero_grad()
                worker.force_sync()  # every step handed in and its round adopted
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        assert hit.wait(60), "the relay never reached the moment"
        relay._save_on_stop = False  # a kill: nothing is saved on the way out
        stopping = threading.Thread(target=relay.stop)
        stopping.start()
        release.set()
        stopping.join(30)
        assert not stopping.is_alive()
        relay = DiLoCoServer(replace(relay_config, port=port)).start()
        thread.join(90)
        assert not thread.is_alive(), "the worker hung"
        assert not errors, errors
        relay_status, up_status = relay.status(), upstream.status()
        got = upstream.global_params()
        served = relay.global_params()
    finally:
        release.set()
        relay.stop()
        upstream.stop()
    assert relay_status["resumed_from"] is not None
    dropped = int(worker.sync_metrics["dropped_steps"])
    assert dropped <= SYNC_EVERY  # at most the steps mixed into a re-sent upload
    for name, start in init.items():  # every step counted upstream once, or counted as dropped
        torch.testing.assert_close(got[name], start - (STEPS - dropped) * G, rtol=0, atol=1e-5)
        assert torch.equal(served[name], got[name])
        assert torch.equal(model.state_dict()[name], got[name])
    # One upload per upstream round: the relay's round of the kill counted once, not twice.
    assert up_status["submissions"] == up_status["round"]
    assert relay_status["upstream"]["round"] == up_status["round"]
