"""A relay's settings (``diloco server --upstream``): what cannot go with it is refused at
construction, naming the flag and why, and the command line says so without a traceback."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.cli.main import main
from diloco.server.config import ServerConfig

UP = "10.0.0.5:8512"


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"mode": "async"}, "--async"),
        ({"allreduce": True}, "--allreduce"),
        ({"swarm": True}, "--swarm"),
        ({"num_fragments": 4}, "--num-fragments"),
        ({"download_codec": "int8"}, "--download-codec"),
        ({"clip_norm_factor": 3.0}, "--clip-norm-factor"),
        ({"outer_rule": "sparseloco"}, "--outer-rule sparseloco"),
        ({"initial_params": "model.safetensors"}, "--init"),
        ({"from_checkpoint": "ckpt/round-000000001"}, "--from-checkpoint"),
    ],
)
def test_what_a_relay_cannot_do_is_refused_by_name(fields: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=f"--upstream .*cannot go with {flag}"):
        ServerConfig(upstream=UP, **fields)
    ServerConfig(**fields)  # fine without --upstream


def test_a_relay_runs_whole_model_rounds_and_a_known_codec() -> None:
    assert ServerConfig(upstream=UP).num_fragments == 1  # a worker asking for fragments: 409
    assert ServerConfig().num_fragments is None  # a plain server: as its first worker asks
    assert ServerConfig(upstream=UP, num_fragments=1).upstream_codec == "bf16"  # a worker's default
    with pytest.raises(ValueError, match="upstream_codec must be one of fp32, bf16"):
        ServerConfig(upstream=UP, upstream_codec="int8")
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig(upstream=" ")


def test_the_command_line_refuses_a_relay_in_async_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--upstream", UP, "--async"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --upstream (a relay) cannot go with --async")
