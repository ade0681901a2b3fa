"""The diloco command line."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from diloco import DiLoCoServer, ServerConfig
from diloco.cli.main import main
from tests.helpers.ranks import free_port


@pytest.fixture(scope="module")
def server():
    import torch

    srv = DiLoCoServer(
        ServerConfig(port=0, num_workers=2), initial_params={"w": torch.zeros(3)}
    ).start()
    yield srv
    srv.stop()


def test_status_table_and_json(server: DiLoCoServer, capsys: pytest.CaptureFixture[str]) -> None:
    from diloco import DiLoCoClient

    DiLoCoClient(server.address).register("alpha", hostname="box1")
    assert main(["status", "--server", server.address]) == 0
    out = capsys.readouterr().out
    assert "round 0" in out and "alpha" in out and "box1" in out and "waiting for workers" in out
    assert main(["status", "--server", server.address, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["mode"] == "sync" and [w["worker_id"] for w in st["workers"]] == ["alpha"]


def test_status_of_a_dead_server_fails_clearly(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # a port nobody listens on
    with caplog.at_level(logging.WARNING):
        assert main(["status", "--server", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Start one with `diloco server`" in err
    # Said once, by the command: the client's single attempt logs no warning of its own.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_from_checkpoint_names_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The reference's `--from-checkpoint DIR/checkpoint-25`: a folder that does not exist, or
    # one of another system, is refused at start naming the folder and the way out.
    missing = tmp_path / "checkpoint-25"
    assert main(["server", "--port", "0", "--from-checkpoint", str(missing)]) == 2
    assert f"{missing}: no such checkpoint folder" in capsys.readouterr().err
    foreign = tmp_path / "checkpoint-1000"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_bytes(b"\x80")
    assert main(["server", "--port", "0", "--from-checkpoint", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "not a complete diloco checkpoint" in err and "--init" in err


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["server", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: port {port} on 127.0.0.1 is in use"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
