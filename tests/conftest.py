"""The test lanes (tests/README.md), enforced rather than hoped for.

A test's folder is its lane: ``unit/`` may not open a network socket, start a process or sleep;
``integration/`` may serve HTTP in-process on 127.0.0.1 but may not start a process. A test
that breaks its lane's rule fails with a message that names the rule, so a slow or flaky
dependency cannot creep into the fast lane unnoticed. ``processes/`` and ``browser/`` are
marked (``slow``, ``browser``) so that ``./dev test`` leaves them to ``./dev test --all``.
"""

from __future__ import annotations

import asyncio
import multiprocessing.process
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Fixtures more than one lane uses, visible to every test module (tests/helpers/fixtures.py).
from tests.helpers.fixtures import make_server, server_of  # noqa: F401

HERE = Path(__file__).resolve().parent
MARKS = {"processes": "slow", "browser": "browser"}


def lane_of(path: Path) -> str:
    """The lane folder a test file sits in (``unit``, ``integration``, ...)."""
    return path.resolve().relative_to(HERE).parts[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = MARKS.get(lane_of(Path(str(item.fspath))))
        if mark is not None and mark not in item.keywords:
            # Declared in each module (``pytestmark``) for the reader; checked here so that a
            # new module in the folder cannot slip into the fast lane by forgetting it.
            raise pytest.UsageError(f"{item.nodeid}: tests in this folder need @pytest.mark.{mark}")


class LaneError(AssertionError):
    """A test did what its lane forbids."""


def _forbid(lane: str, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LaneError(f"tests/{lane}/ may not {what} (tests/README.md): move the test")

    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """The lane's rules hold for the whole of a test: its setup (module and session fixtures
    that the test is first to need included), its call and its teardown."""
    lane = lane_of(Path(str(item.fspath)))
    with pytest.MonkeyPatch.context() as patch:
        if lane in ("unit", "integration"):
            _no_processes(patch, lane)
        if lane == "unit":
            _no_network_and_no_sleep(patch, lane)
        return (yield)


def _no_processes(patch: pytest.MonkeyPatch, lane: str) -> None:
    patch.setattr(subprocess.Popen, "_execute_child", _forbid(lane, "start a process"))
    patch.setattr(multiprocessing.process.BaseProcess, "start", _forbid(lane, "start a process"))


def _no_network_and_no_sleep(patch: pytest.MonkeyPatch, lane: str) -> None:
    for name in ("bind", "connect", "connect_ex"):
        patch.setattr(socket.socket, name, _forbid(lane, "open a network socket"))
    real_sleep, real_async_sleep = time.sleep, asyncio.sleep

    def sleep(seconds: float) -> None:
        if seconds > 0:
            raise LaneError("tests/unit/ may not sleep: use a fake clock or an event")
        real_sleep(0)

    async def async_sleep(delay: float, result: Any = None) -> Any:
        if delay > 0:
            raise LaneError("tests/unit/ may not sleep: use a fake clock or an event")
        return await real_async_sleep(0, result)

    patch.setattr(time, "sleep", sleep)
    patch.setattr(asyncio, "sleep", async_sleep)
