"""Driving the ``diloco`` command line in-process: the config ``diloco server`` would start with."""

from __future__ import annotations

import pytest

from diloco import ServerConfig


def captured_config(monkeypatch: pytest.MonkeyPatch) -> list[ServerConfig]:
    """Stand in for DiLoCoServer so ``diloco server`` returns with the config it built."""
    import diloco.server

    seen: list[ServerConfig] = []

    class FakeServer:
        def __init__(self, config: ServerConfig) -> None:
            seen.append(config)

        def run(self) -> None:
            pass

    monkeypatch.setattr(diloco.server, "DiLoCoServer", FakeServer)
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    monkeypatch.delenv("DILOCO_ADMIN_TOKEN", raising=False)
    return seen
