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

import pytest

from diloco import DiLoCoServer, ServerConfig
from diloco.server.relay.upstream import RelayStopped
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
