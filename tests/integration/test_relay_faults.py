"""A relay that dies at the exact moments that matter and comes back from its save dir
(``--save-every 1``): after its round closed on its worker's acknowledged upload but before its
upload upstream, and after the upstream counted that upload but before the relay published the
result. The relay is stopped in-process at a hook in its upstream link, with nothing saved on
the way out, as a kill -9 would leave it; a new relay then starts on the same port from the
same save dir.

The ledger is ``tests/helpers/relays.py``'s ``Ledger``: an upload counted twice upstream, or
lost, shows up in the upstream's parameters as a multiple of one step."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from diloco import DiLoCoServer, ServerConfig
from diloco.server.relay.upstream import RelayStopped
from diloco.worker.transport.client import Unreachable
from tests.helpers.relays import Ledger, upstream_of

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
    ledger = Ledger(relay.address, STEPS, SYNC_EVERY)
    try:
        assert hit.wait(60), "the relay never reached the moment"
        relay._save_on_stop = False  # a kill: nothing is saved on the way out
        stopping = threading.Thread(target=relay.stop)
        stopping.start()
        release.set()
        stopping.join(30)
        assert not stopping.is_alive()
        relay = DiLoCoServer(replace(relay_config, port=port)).start()
        ledger.finish(90)
        relay_status, up_status = relay.status(), upstream.status()
        got, served = upstream.global_params(), relay.global_params()
    finally:
        release.set()
        relay.stop()
        upstream.stop()
    assert relay_status["resumed_from"] is not None
    assert ledger.dropped <= SYNC_EVERY  # at most the steps mixed into a re-sent upload
    ledger.check(got, served)
    # One upload per upstream round: the relay's round of the kill counted once, not twice.
    assert up_status["submissions"] == up_status["round"]
    assert relay_status["upstream"]["round"] == up_status["round"]


@pytest.mark.timeout(120)
def test_a_relay_survives_an_upstream_restart_as_a_worker_does(tmp_path: Path) -> None:
    """The upstream (``--save-every 1``) stops while the relay is about to send a round's mean
    and restarts from its save dir once that upload has failed: the relay keeps trying, meets a
    server that does not know it (410), registers again under its id and sends the same
    submission, and every step is counted once."""
    up_config = ServerConfig(
        port=0,
        num_workers=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        nesterov=False,
        save_dir=str(tmp_path / "upstream"),
        save_every=1,
    )
    upstream = DiLoCoServer(up_config).start()
    port = upstream.port
    relay = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, upstream=upstream.address, upstream_codec="fp32")
    ).start()
    hit, release = threading.Event(), threading.Event()

    def hold(at: str, sid: str) -> None:
        if at == "upload" and sid.split(":")[1] == str(KILL_ROUND) and not hit.is_set():
            hit.set()
            release.wait(30)

    link = upstream_of(relay)
    link.at = hold
    # The upload meets no upstream first: the client gives up at once, the link tries again.
    link.client.retries, failed = 0, threading.Event()
    submit = link.client.submit_pseudogradients

    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return submit(*args, **kwargs)
        except Unreachable:
            failed.set()
            raise

    link.client.submit_pseudogradients = watched  # type: ignore[method-assign]
    ledger = Ledger(relay.address, STEPS, SYNC_EVERY)
    try:
        assert hit.wait(60), "the relay never reached the moment"
        upstream.stop()
        release.set()
        assert failed.wait(30), "the relay's upload never found the upstream gone"
        upstream = DiLoCoServer(replace(up_config, port=port)).start()
        ledger.finish(90)
        relay_status, up_status = relay.status(), upstream.status()
        got, served = upstream.global_params(), relay.global_params()
    finally:
        release.set()
        relay.stop()
        upstream.stop()
    assert up_status["resumed_from"] is not None and relay_status["upstream"]["last_error"] is None
    assert ledger.dropped == 0  # the relay held the round; its worker lost nothing
    ledger.check(got, served)
    assert relay_status["upstream"]["round"] == up_status["round"]
