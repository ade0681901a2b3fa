"""The worker's switches: ``enabled=False``/``DILOCO_ENABLED=0`` turns DiLoCo off, the server's
own ``DILOCO_*`` variables do not stop a worker, and SIGTERM becomes a clean exit
(``diloco.worker.settings``, ``diloco.worker.termination``). No socket: an off worker opens
none, and the SIGTERM handler is called directly, never through a real signal."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.worker import DiLoCoWorker
from diloco.worker.settings import SERVER_ONLY, env_overrides, off_reason, resolve, to_env
from diloco.worker.termination import EXIT_STATUS, SigtermExit, Terminated
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.workers import fake_step, make_model, params_of


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("DILOCO_"):
            monkeypatch.delenv(name)


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM at its default action for the test, and back as it was after."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


class NoNetwork(DiLoCoClient):
    """A client whose every request fails the test: an off worker must make none."""

    def _with_retries(self, what: str, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"an off worker made a request: {what}")


# --- enabled=False ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "env", "why"),
    [
        ({"enabled": False}, {}, "enabled=False"),
        ({}, {"DILOCO_ENABLED": "0"}, "DILOCO_ENABLED=0"),
        ({}, {"DILOCO_ENABLED": "false"}, "DILOCO_ENABLED=false"),
    ],
)
def test_an_off_worker_leaves_the_loop_untouched_and_says_why_once(
    kwargs: dict[str, bool],
    env: dict[str, str],
    why: str,
    clean_env: None,
    default_sigterm: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    alone, model = make_model(), make_model()
    opt_alone = torch.optim.SGD(alone.parameters(), lr=1.0, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    threads = set(threading.enumerate())
    client = NoNetwork("127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="diloco"):
        with DiLoCoWorker(model, opt, sync_every=2, client=client, **kwargs) as w:
            assert w.enabled is False
            assert not opt._optimizer_step_post_hooks  # no hook
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # no handler either
            for step in range(5):  # past two sync points
                fake_step(alone, opt_alone, 0.1 * step)
                fake_step(model, opt, 0.1 * step)
                w.report(loss=1.0, samples=4)
            w.force_sync()  # nothing to sync with: returns
            metrics = w.sync_metrics
    assert set(threading.enumerate()) == threads  # no thread
    assert client.bytes_up == client.bytes_down == 0
    for name, value in params_of(alone).items():  # the same training, bit for bit
        assert torch.equal(params_of(model)[name], value)
    for p, q in zip(model.parameters(), alone.parameters(), strict=True):  # and momentum
        assert torch.equal(opt.state[p]["momentum_buffer"], opt_alone.state[q]["momentum_buffer"])
    assert metrics["rounds"] == metrics["bytes_up"] == metrics["round"] == 0
    assert metrics["sync_every"] == 2 and w.worker_id is None
    off = [r for r in caplog.records if "DiLoCo is off" in r.getMessage()]
    assert len(off) == 1 and f"({why})" in off[0].getMessage()
    assert len(caplog.records) == 1  # that line alone


def test_the_argument_wins_over_the_variable_and_bad_values_are_errors(clean_env: None) -> None:
    assert off_reason(None, {}) is None
    assert off_reason(None, {"DILOCO_ENABLED": "1"}) is None
    assert off_reason(True, {"DILOCO_ENABLED": "0"}) is None
    assert off_reason(False, {"DILOCO_ENABLED": "1"}) == "enabled=False"
    assert resolve({}, {"DILOCO_ENABLED": "off"}).enabled is False
    assert to_env(resolve({"enabled": False}, {}))["DILOCO_ENABLED"] == "0"  # reaches a command
    with pytest.raises(ValueError, match="DILOCO_ENABLED='maybe' is not a boolean"):
        off_reason(None, {"DILOCO_ENABLED": "maybe"})


# --- the server's variables ---------------------------------------------------------------------


def test_the_servers_own_variables_are_ignored_and_typos_still_refused() -> None:
    env = {"DILOCO_ADMIN_TOKEN": "admin-secret", "DILOCO_TOKEN": "t", "DILOCO_SYNC_EVERY": "9"}
    assert env_overrides(env) == {"token": "t", "sync_every": 9}
    with pytest.raises(ValueError, match="unknown environment variable DILOCO_SYNC_EVRY"):
        env_overrides({**env, "DILOCO_SYNC_EVRY": "9"})


def test_server_only_names_every_server_variable_that_is_not_the_workers() -> None:
    server_vars = {
        f.metadata["env"] for f in dataclasses.fields(ServerConfig) if "env" in f.metadata
    }
    worker_vars = set(to_env(resolve({"token": "t"}, {})))  # every variable the worker reads
    assert SERVER_ONLY == server_vars - worker_vars


# --- SIGTERM ------------------------------------------------------------------------------------


def _handler() -> object:
    return signal.getsignal(signal.SIGTERM)


def test_sigterm_outside_a_sync_is_a_clean_exit_inside_one_it_is_not(
    default_sigterm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[object] = []
    monkeypatch.setattr("atexit.register", registered.append)
    left: list[bool] = []
    sigterm = SigtermExit(left.append)
    assert sigterm.install()
    handle = _handler()
    assert callable(handle)
    with pytest.raises(Terminated) as outside:
        handle(signal.SIGTERM, None)
    assert outside.value.clean and outside.value.code == EXIT_STATUS == 143
    with pytest.raises(Terminated) as inside, sigterm.syncing():
        handle(signal.SIGTERM, None)
    assert not inside.value.clean
    # The exception escaped every with-block: at interpreter exit the worker leaves, handing
    # in its steps as the first signal allowed.
    assert len(registered) == 1
    registered[0]()  # type: ignore[operator]
    assert left == [True]
    sigterm.restore()
    assert _handler() is signal.SIG_DFL


def test_sigterm_handlers_of_others_are_left_alone(default_sigterm: None) -> None:
    def own(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, own)
    sigterm = SigtermExit(lambda submit: None)
    assert not sigterm.install()
    sigterm.restore()
    assert _handler() is own
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert sigterm.install()
    signal.signal(signal.SIGTERM, own)  # the program took it after the worker started
    sigterm.restore()
    assert _handler() is own  # not put back to the default over the program's


def test_no_handler_off_the_main_thread(default_sigterm: None) -> None:
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(SigtermExit(lambda s: None).install()))
    t.start()
    t.join()
    assert got == [False] and _handler() is signal.SIG_DFL


class Leaving(DiLoCoWorker):
    """Records how the worker was stopped instead of leaving a run."""

    def stop(self, *, submit: bool = True) -> None:
        self.stopped_with = submit


@pytest.mark.parametrize(
    ("exc", "submit"),
    [
        (None, True),
        (Terminated(clean=True), True),  # outside a sync: the last steps go
        (Terminated(clean=False), False),  # inside one: like Ctrl-C
        (KeyboardInterrupt(), False),
        (RuntimeError("crash"), False),
    ],
)
def test_exit_hands_in_the_last_steps_only_when_the_model_holds_parameters(
    exc: BaseException | None, submit: bool, clean_env: None
) -> None:
    model = make_model()
    w = Leaving(model, torch.optim.SGD(model.parameters(), lr=1.0), client=NoNetwork("h:1"))
    w.__exit__(type(exc) if exc else None, exc, None)
    assert w.stopped_with is submit
