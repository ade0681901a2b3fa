"""``-o/--output-dir`` as the reference's: one folder for the model a run starts from and the
checkpoints it writes; ``--init`` and ``--save-dir``, given, take the place of either half."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from diloco.cli import flags
from diloco.cli.main import build_parser, main
from diloco.server.config import ServerConfig


def parse(*argv: str) -> ServerConfig:
    return ServerConfig(**flags.values(ServerConfig, build_parser().parse_args(["server", *argv])))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DILOCO_"):
            monkeypatch.delenv(name)


def test_the_references_command_lines() -> None:
    config = parse("-o", "path/to/model", "-n", "2", "--save-every", "10")
    assert (config.output_dir, config.save_dir, config.save_every) == (
        "path/to/model", str(Path("path/to/model") / "checkpoints"), 10,
    )  # fmt: skip
    resumed = parse(
        "-o", "./model", "-n", "2", "--from-checkpoint", "./model/checkpoints/checkpoint-25"
    )
    assert resumed.save_dir == str(Path("model") / "checkpoints")
    assert resumed.from_checkpoint == "./model/checkpoints/checkpoint-25"
    assert parse("--output-dir", "m").save_dir == str(Path("m") / "checkpoints")


def test_explicit_flags_take_the_place_of_their_half() -> None:
    config = parse("-o", "model", "--save-dir", "elsewhere", "--init", "other.pt")
    assert (config.save_dir, config.initial_params) == ("elsewhere", "other.pt")
    assert ServerConfig(output_dir="model", save_dir="ckpt").save_dir == "ckpt"


def test_without_it_nothing_is_saved_as_before() -> None:
    assert ServerConfig().save_dir is None
    with pytest.raises(ValueError, match=r"needs save_dir \(--save-dir DIR, or -o DIR\)"):
        ServerConfig(save_every=10)


def test_all_reduce_mode_refuses_it_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--output-dir .*holds no parameters.*workers --save-dir"):
        ServerConfig(allreduce=True, output_dir="model")
    assert main(["server", "--allreduce", "-o", "model"]) == 2
    assert "--output-dir" in capsys.readouterr().err
