"""The all-reduce rendezvous (server/allreduce/rendezvous.py behind its real routes,
server/web/rendezvous_routes.py) served alone on 127.0.0.1 from a thread, for tests of the
quorum collectives that form groups without a quorum book: every quorum id is known, and its
members are the workers ``rank-0`` .. ``rank-63`` (a member of rank r calls as ``rank-r``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.server.web import rendezvous_routes
from diloco.wire.messages import Rendezvous
from diloco.wire.messages.rendezvous import PATH
from diloco.worker.allreduce.http_store import HttpMeeting
from diloco.worker.transport.client import DiLoCoClient

T = TypeVar("T")
MEMBERS = tuple(f"rank-{r}" for r in range(64))


class RendezvousHost:
    """``with RendezvousHost(timeout) as host``: ``host.address`` (``127.0.0.1:port``),
    ``host.meeting(rank)`` for a member in this process, ``host.call(fn)`` to run ``fn(store)``
    on the server's loop (the store is not thread-safe)."""

    def __init__(self, timeout: float) -> None:
        self.store = RendezvousStore(lambda quorum_id: MEMBERS, max_wait=timeout)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.address = ""
        self._thread = threading.Thread(target=self._serve, name="rendezvous-host", daemon=True)
        self._clients: list[DiLoCoClient] = []

    def quorums(self) -> RendezvousHost:  # the Front's side the routes use
        return self

    @property
    def rendezvous(self) -> RendezvousStore:
        return self.store

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.add_routes(rendezvous_routes.routes(self))  # type: ignore[arg-type]
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.address = f"127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> RendezvousHost:
        self._thread.start()
        assert self._ready.wait(10), "the rendezvous host did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        for client in self._clients:
            client.close()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def call(self, fn: Callable[[RendezvousStore], T]) -> T:
        async def run() -> T:
            return fn(self.store)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def meeting(self, rank: int) -> HttpMeeting:
        client = DiLoCoClient(self.address, retries=0, read_timeout=30.0)
        self._clients.append(client)
        return member_meeting(client, rank)


def member_meeting(client: DiLoCoClient, rank: int) -> HttpMeeting:
    """Where the member of ``rank`` meets, through ``client`` (a process of its own makes its
    own client for ``RendezvousHost.address``)."""
    return HttpMeeting(client, MEMBERS[rank], Rendezvous(path=PATH))
