"""The worker's log is visible with no logging set up, at DILOCO_LOG_LEVEL, and never twice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco.cli.main import main

pytestmark = pytest.mark.slow

# A training script that sets up no logging (or, with SETUP, its own): a server and one worker
# in one process, two rounds.
SCRIPT = """
import logging, os, sys, torch
if os.environ.get("SETUP"):
    logging.basicConfig(level=logging.INFO, format="OWN %(name)s: %(message)s")
from diloco.server import DiLoCoServer, ServerConfig
from diloco.worker import DiLoCoWorker
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
server = DiLoCoServer(ServerConfig(port=0, num_workers=1), initial_params=dict(
    (n, p.detach().clone()) for n, p in model.named_parameters())).start()
with DiLoCoWorker(model, opt, server.address, sync_every=2, heartbeat_interval=0) as w:
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
        w.report(loss=1.0)
server.stop()
"""


def run_script(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stderr


@pytest.mark.timeout(180)
def test_joins_and_rounds_show_without_logging_setup() -> None:
    err = run_script()
    assert err.count("joined at round 0") == 1, err
    assert "round 1 closed with this worker's 2 steps" in err, err
    assert "INFO diloco.worker" in err


@pytest.mark.timeout(180)
def test_the_level_variable_and_the_programs_own_logging_win() -> None:
    assert "joined at round" not in run_script(DILOCO_LOG_LEVEL="WARNING")
    own = run_script(SETUP="1")
    assert own.count("joined at round 0") == 1, own  # shown once, by the program's handler
    assert "OWN diloco.worker.worker: worker" in own


def test_diloco_worker_gives_the_child_a_log_level(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DILOCO_LOG_LEVEL", raising=False)
    show = [sys.executable, "-c", "import os; print(os.environ['DILOCO_LOG_LEVEL'])"]
    assert main(["worker", "--", *show]) == 0
    assert capfd.readouterr().out.strip() == "INFO"
    assert main(["--log-level", "DEBUG", "worker", "--", *show]) == 0
    assert capfd.readouterr().out.strip() == "DEBUG"
    monkeypatch.setenv("DILOCO_LOG_LEVEL", "WARNING")
    assert main(["worker", "--", *show]) == 0
    assert capfd.readouterr().out.strip() == "WARNING"
    assert main(["--log-level", "LOUD", "worker", "--", *show]) == 2
    assert "log_level must be" in capfd.readouterr().err
