"""kill -9 of a relay process (``diloco server --upstream``, ``--save-every 1``) right after
its round closed on its worker's acknowledged upload, before and after its upload upstream
counted; restarted from its save dir on the same port. The upstream counts the round once, no
step is lost or doubled (``tests/helpers/relays.py``'s ledger), and the run goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco import DiLoCoServer, ServerConfig
from tests.helpers.procs import ServerProcess
from tests.helpers.relays import Ledger
from tests.helpers.servers import published

pytestmark = pytest.mark.slow

SYNC_EVERY = 3
STEPS = 15  # five rounds


@pytest.mark.timeout(150)
@pytest.mark.parametrize("moment", ["relay_upload@2", "relay_counted@2"])
def test_relay_kill9_after_acknowledging_counts_its_round_once(tmp_path: Path, moment: str) -> None:
    upstream = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    ).start()
    common = [
        *("--upstream", upstream.address, "--upstream-codec", "fp32"),
        *("--save-dir", str(tmp_path / "relay"), "--save-every", "1", "--poll-timeout", "2"),
    ]
    log = tmp_path / "relay.log"
    relay = ServerProcess(["--port", "0", *common], log, crash_at=moment)
    port = relay.port
    try:
        ledger = Ledger(relay.address, STEPS, SYNC_EVERY)
        assert relay.wait_exit(timeout=60) == -9, "the relay was not killed at the moment"
        assert f"CRASHPOINT {moment}" in log.read_text()
        relay = ServerProcess(["--port", str(port), *common], log)
        ledger.finish(90)
        status, up_status = relay.status(), upstream.status()
        _, served = published(relay.address)
        got = upstream.global_params()
    finally:
        relay.stop()
        upstream.stop()
    assert status is not None and status["resumed_from"] is not None
    assert ledger.dropped <= SYNC_EVERY  # at most the steps mixed into a re-sent upload
    ledger.check(got, served)
    assert up_status["submissions"] == up_status["round"] == status["upstream"]["round"]
