"""A worker that fails while joining leaves nothing behind: the server's registry no longer holds
it when the error reaches the caller, so no round waits for it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.transport.client import Unreachable
from tests.helpers.ranks import free_port
from tests.helpers.servers import ServerFactory


def registered(server: DiLoCoServer) -> list[str]:
    return [w["worker_id"] for w in server.status()["workers"]]


def worker(model: torch.nn.Module, opt: Any, server: DiLoCoServer) -> DiLoCoWorker:
    client = DiLoCoClient(server.address, retries=0, connect_timeout=2, read_timeout=10)
    return DiLoCoWorker(model, opt, server.address, heartbeat_interval=0, client=client)


@pytest.fixture
def server(make_server: ServerFactory) -> DiLoCoServer:
    # No join deadline: only the worker's own leaving can empty the registry here.
    return make_server(num_workers=2, join_timeout=0.0)


def test_a_model_that_does_not_match_leaves_before_the_error(server: DiLoCoServer) -> None:
    other = torch.nn.Linear(3, 5)  # the server holds w (3, 4) and b (4,)
    w = worker(other, torch.optim.SGD(other.parameters(), lr=0.1), server)
    with pytest.raises(ValueError, match="does not match the server"):
        w.start()
    assert registered(server) == []
    assert server.status()["registrations"] == 0  # refused at registration: no trace


class RefusesHooks(torch.optim.SGD):
    def register_step_post_hook(self, hook: Any) -> Any:
        raise RuntimeError("this optimizer takes no hooks")


def test_an_optimizer_that_refuses_the_hook_never_registers(server: DiLoCoServer) -> None:
    model = _matching()
    with pytest.raises(RuntimeError, match="takes no hooks"):
        worker(model, RefusesHooks(model.parameters(), lr=0.1), server).start()
    assert registered(server) == [] and server.status()["registrations"] == 0


def test_an_optimizer_without_hooks_is_refused_at_construction(server: DiLoCoServer) -> None:
    class Bare:  # steps, but cannot tell anyone it did
        def step(self) -> None:
            pass

    model = _matching()
    with pytest.raises(ValueError, match="register_step_post_hook"):
        worker(model, Bare(), server).start()
    assert server.status()["registrations"] == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt(), Unreachable("download: gave up")])
def test_an_interrupted_first_download_leaves_and_closes_the_client(
    server: DiLoCoServer, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    model = _matching()
    w = worker(model, torch.optim.SGD(model.parameters(), lr=0.1), server)
    closed: list[bool] = []
    close = w.client.close
    monkeypatch.setattr(w.client, "close", lambda: (closed.append(True), close()))

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(w.client, "download", fail)
    with pytest.raises(type(error)):
        w.start()
    assert registered(server) == [] and closed == [True]
    assert w._hook is None  # an optimizer step no longer reaches the worker


def _matching() -> torch.nn.Module:
    """A module whose parameters are the fixture server's: ``w`` (3, 4) and ``b`` (4,)."""
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(3, 4))
    module.b = torch.nn.Parameter(torch.zeros(4))
    return module


def test_heartbeats_run_during_the_first_download_and_stop_with_a_failed_start(
    server: DiLoCoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first download of a big model may outlast the heartbeat timeout: heartbeats start once
    the worker is registered, and a failed start stops them."""
    model = _matching()
    w = DiLoCoWorker(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        server.address,
        heartbeat_interval=3600,
        client=DiLoCoClient(server.address, retries=0),
    )
    seen: list[bool] = []

    def fail(*args: Any, **kwargs: Any) -> None:
        seen.append(w._heartbeats.thread is not None and w._heartbeats.thread.is_alive())
        raise Unreachable("download: gave up")

    monkeypatch.setattr(w.client, "download", fail)
    with pytest.raises(Unreachable):
        w.start()
    assert seen == [True]
    assert w._heartbeats.thread is not None and not w._heartbeats.thread.is_alive()


def test_waiting_for_the_initial_parameters_is_a_join() -> None:
    """GET /global_params counts even while it gets 503 (another worker is still seeding)."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=2)) as server:
        client = DiLoCoClient(server.address, retries=0)
        worker_id = client.register(hostname="h")["worker_id"]
        record = server.front.registry.get(worker_id)
        assert record is not None and not record.joined
        with pytest.raises(Unreachable):
            client.download(lambda layout: memoryview(bytearray()), worker_id=worker_id)
        assert record.joined
        client.close()


def test_no_server_running_says_how_to_start_one() -> None:
    """The first day's most common error: the message says what to do, and the transport's
    chained tracebacks are cut (the last error is in the message)."""
    port = free_port()  # closed again: nothing listens there
    model = torch.nn.Linear(3, 4)
    client = DiLoCoClient(f"127.0.0.1:{port}", retries=0, connect_timeout=2)
    w = DiLoCoWorker(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        f"127.0.0.1:{port}",
        heartbeat_interval=0,
        client=client,
    )
    with pytest.raises(Unreachable, match="Is a diloco server running at .*`diloco server`") as err:
        w.start()
    assert err.value.__cause__ is None and err.value.__suppress_context__
