"""The diloco command line."""

from __future__ import annotations

import sys

import pytest

from diloco.cli.main import main
from diloco.worker.settings import (
    WorkerSettings,
    resolve,
    to_env,
)
from tests.helpers.codecs import worker

pytestmark = pytest.mark.slow


def test_worker_passes_settings_as_environment(capfd: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "worker",
            "--server",
            "10.1.2.3:9000",
            "--sync-every",
            "9",
            "--no-bf16",
            "--worker-id",
            "abc",
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['DILOCO_SERVER'], os.environ['DILOCO_SYNC_EVERY'], "
            "os.environ['DILOCO_BF16_COMM'], os.environ['DILOCO_WORKER_ID'])",
        ]
    )
    assert code == 0
    assert capfd.readouterr().out.strip() == "10.1.2.3:9000 9 0 abc"


def test_worker_passes_streaming_and_dylu_settings(capfd: pytest.CaptureFixture[str]) -> None:
    keys = ["NUM_FRAGMENTS", "FRAGMENT_PATTERN", "OVERLAP_STEPS", "MERGE_ALPHA", "DYLU"]
    show = "import os; print(" + ", ".join(f"os.environ['DILOCO_{k}']" for k in keys) + ")"
    code = main(
        [
            "worker",
            "--sync-every",
            "40",
            "--num-fragments",
            "4",
            "--fragment-pattern",
            "strided",
            "--overlap-steps",
            "1",
            "--merge-alpha",
            "0.25",
            "--dylu",
            "--",
            sys.executable,
            "-c",
            show,
        ]
    )
    assert code == 0
    assert capfd.readouterr().out.split() == ["4", "strided", "1", "0.25", "1"]
    # Settings are validated before the command runs: more fragments than steps per period.
    assert main(["worker", "--sync-every", "2", "--num-fragments", "3", "--", "true"]) == 2


def test_worker_propagates_exit_code_and_needs_a_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["worker", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert main(["worker"]) == 2
    assert "give the training command" in capsys.readouterr().err
    assert main(["worker", "--", "/nonexistent/trainer"]) == 127



def test_error_feedback_is_on_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DILOCO_ERROR_FEEDBACK", raising=False)
    assert WorkerSettings().error_feedback is True
    assert resolve({}, {"DILOCO_ERROR_FEEDBACK": "0"}).error_feedback is False
    assert resolve({"error_feedback": True}, {"DILOCO_ERROR_FEEDBACK": "0"}).error_feedback
    assert to_env(WorkerSettings(error_feedback=False))["DILOCO_ERROR_FEEDBACK"] == "0"
    assert worker(codec="int8")._encoder.feedback is not None
    assert worker(codec="int8", error_feedback=False)._encoder.feedback is None
    monkeypatch.setenv("DILOCO_ERROR_FEEDBACK", "0")
    w = worker(codec="int4")
    assert w.settings.error_feedback is False and w._encoder.feedback is None
    monkeypatch.delenv("DILOCO_ERROR_FEEDBACK")
    show = "import os; print(os.environ['DILOCO_ERROR_FEEDBACK'])"
    argv = ["worker", "--codec", "int8", "--no-error-feedback", "--", sys.executable, "-c", show]
    assert main(argv) == 0
    assert capfd.readouterr().out.strip() == "0"


def test_diloco_worker_codec_flag_reaches_the_command(capfd: pytest.CaptureFixture[str]) -> None:
    show = "import os; print(os.environ['DILOCO_CODEC'])"
    assert main(["worker", "--codec", "lowrank:8", "--", sys.executable, "-c", show]) == 0
    assert capfd.readouterr().out.strip() == "lowrank:8"
    assert main(["worker", "--codec", "int3", "--", "true"]) == 2  # checked before it runs
