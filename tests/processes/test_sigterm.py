"""SIGTERM (a scheduler's, ``kill``) ends a worker cleanly: outside a sync it hands in its last
local steps and deregisters, and exits with 143; ``diloco worker`` passes the signal on to its
command and waits for it (``diloco.worker.termination``, ``diloco.cli.worker``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.server.server import DiLoCoServer
from diloco.worker.termination import EXIT_STATUS
from tests.helpers.servers import ServerFactory
from tests.helpers.workers import make_model, params_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _spawn(argv: list[str], server: DiLoCoServer) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(
        DILOCO_SERVER=server.address,
        DILOCO_SYNC_EVERY="100",  # no sync during the steps: only the final upload sends them
        DILOCO_HEARTBEAT_INTERVAL="0",
        DILOCO_BF16_COMM="0",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    )
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _terminate_when_ready(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the worker joined and took its steps
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _assert_left_after_handing_in(server: DiLoCoServer, err: str) -> None:
    status = server.status()
    assert status["registrations"] == 1, err
    assert status["workers"] == [], err  # deregistered
    assert status["round"] == 1, err  # the final upload closed round 0 (the only worker)
    start = params_of(make_model())
    for name, value in server.global_params().items():  # outer lr 1, no momentum: + STEPS
        torch.testing.assert_close(value, start[name] + STEPS)


@pytest.mark.timeout(120)
def test_sigterm_between_steps_hands_in_the_last_steps_and_deregisters(
    make_server: ServerFactory,
) -> None:
    server = make_server(params_of(make_model()), outer_lr=1.0, outer_momentum=0.0)
    proc = _spawn([sys.executable, "-m", "tests.programs.sigterm_worker", str(STEPS)], server)
    code, out, err = _terminate_when_ready(proc)
    assert code == EXIT_STATUS == 143, err
    assert "left without a signal" not in out
    assert "SIGTERM: leaving the run after handing in the last local steps" in err
    _assert_left_after_handing_in(server, err)


@pytest.mark.timeout(120)
def test_diloco_worker_passes_sigterm_on_and_waits_for_its_command(
    make_server: ServerFactory,
) -> None:
    server = make_server(params_of(make_model()), outer_lr=1.0, outer_momentum=0.0)
    argv = [sys.executable, "-m", "diloco.cli.main", "worker", "--"]
    argv += [sys.executable, "-m", "tests.programs.sigterm_worker", str(STEPS)]
    proc = _spawn(argv, server)
    # The signal goes to the CLI's process alone, as `kill PID` sends it.
    code, out, err = _terminate_when_ready(proc)
    assert code == EXIT_STATUS, err  # the command's status, passed through
    assert "SIGTERM: leaving the run" in err
    _assert_left_after_handing_in(server, err)
