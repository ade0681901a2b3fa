"""Command lines written for the reference (Forgather's ``diloco worker -p PROJECT -t TEMPLATE
train -d N``) end at once with an error that says what to write instead (issue 27): none is
accepted and then does something else."""

from __future__ import annotations

import pytest

from diloco.cli.main import main


def test_project_options_name_the_diloco_form(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["worker", "--sync-every", "500", "-p", "proj", "-t", "train.yaml", "train"]
    assert main([*argv, "--num-shards", "2", "--shard-index", "0", "-d", "0"]) == 2
    err = capsys.readouterr().err
    assert "-p/-t" in err and "diloco worker --sync-every 500 -- python train.py" in err
    assert "CUDA_VISIBLE_DEVICES=0" in err


def test_devices_option_alone_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "-d", "1", "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "-d:" in err and "CUDA_VISIBLE_DEVICES=1" in err


def test_a_command_that_is_no_program_says_how_commands_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    def missing(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        raise FileNotFoundError(2, "No such file or directory")

    # Stands in for the process start (this lane starts none): what the OS says for `train`.
    monkeypatch.setattr(subprocess, "Popen", missing)
    assert main(["worker", "--sync-every", "500", "--dylu", "--", "train"]) == 127
    err = capsys.readouterr().err
    assert "command not found: train" in err and "-- python train.py" in err
