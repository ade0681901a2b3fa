"""``diloco swarm-peer``'s flags reach ``SwarmPeer``: ``--sync-every N`` is its ``sync_every``
(stage sync), absent is None (no stage sync, as before the flag)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import diloco.cli.swarm_peer as cli
from diloco.cli.main import main
from diloco.swarm import SwarmPeer

ARGV = ["swarm-peer", "--model", "tests.programs.swarm_model:build_stage", "--stages", "3"]
ARGV += ["--boundary", "32", "--server", "127.0.0.1:1"]


class FakePeer:
    """Records what the command builds a peer with; a body that serves and leaves at once."""

    made: list[FakePeer] = []

    def __init__(self, build: Any, **kwargs: Any) -> None:
        # The real constructor accepts these very arguments (a renamed keyword fails here).
        inspect.signature(SwarmPeer).bind(build, **kwargs)
        self.kwargs, self.stage, self.served, self.stopped = kwargs, 1, False, False
        FakePeer.made.append(self)

    def start(self) -> FakePeer:
        return self

    def serve(self) -> None:
        self.served = True

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakePeer]:
    FakePeer.made = []
    monkeypatch.setattr(cli, "SwarmPeer", FakePeer)
    return FakePeer


def test_sync_every_flag_sets_the_peers_stage_sync(fake: type[FakePeer]) -> None:
    assert main([*ARGV, "--sync-every", "4"]) == 0
    assert main(ARGV) == 0
    with_flag, without = fake.made
    assert with_flag.kwargs["sync_every"] == 4
    assert without.kwargs["sync_every"] is None
    assert all(p.served and p.stopped for p in fake.made)


def test_sync_every_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["swarm-peer", "--help"])
    assert "--sync-every N" in capsys.readouterr().out
