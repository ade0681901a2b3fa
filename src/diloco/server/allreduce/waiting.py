"""All-reduce mode: the quorum requests waiting (``POST /quorum`` long polls), one per worker.
``server/allreduce/quorum_book.py`` files them, places them in a quorum or refuses them; the
route awaits its ``Ticket`` (``Waiting.wait``).

Contract: a worker has at most one request waiting (a newer one settles the older with None: it
answers "pending"); the time it first asked is kept across its re-polls until it is placed or
leaves (the join timeout counts from it). A request that times out is withdrawn, so a worker no
longer polling is not placed in a quorum. Pure state on the server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from diloco.server.errors import ApiError, unknown_worker
from diloco.wire.messages import Assignment, QuorumAsk


class Ticket:
    """One waiting ``POST /quorum``: settled with the worker's quorum reply, with None (the
    worker asked again: this older request answers "pending"), or as ``gone`` (it left)."""

    def __init__(self, ask: QuorumAsk) -> None:
        self.ask = ask
        self.reply: Assignment | None = None
        self.gone = False
        self.refused: ApiError | None = None  # left out while waiting
        self.done = False
        self._event = asyncio.Event()

    def settle(
        self,
        reply: Assignment | None = None,
        *,
        gone: bool = False,
        refused: ApiError | None = None,
    ) -> None:
        self.reply, self.gone, self.refused, self.done = reply, gone, refused, True
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


class Waiting:
    """The requests waiting for a quorum, by worker, and since when each worker asks."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tickets: dict[str, Ticket] = {}
        self._since: dict[str, float] = {}  # first request not yet placed, across re-polls

    def file(self, ask: QuorumAsk) -> Ticket:
        """The worker's request; an older one of its own answers "pending"."""
        worker = ask.worker_id
        older = self._tickets.pop(worker, None)
        if older is not None:
            older.settle(None)
        ticket = self._tickets[worker] = Ticket(ask)
        self._since.setdefault(worker, self._clock())
        return ticket

    def place(self, worker: str, reply: Assignment) -> None:
        """The worker's request is answered with its quorum reply."""
        self._since.pop(worker, None)
        self._tickets.pop(worker).settle(reply)

    def drop(self, worker: str, *, refused: ApiError | None = None) -> None:
        """The worker's request, if any, ends: 410 (it left), or ``refused``."""
        self._since.pop(worker, None)
        ticket = self._tickets.pop(worker, None)
        if ticket is not None:
            ticket.settle(gone=refused is None, refused=refused)

    async def wait(self, ticket: Ticket, timeout: float) -> Assignment | None:
        """The ticket's quorum reply, or None when none came within ``timeout`` (the worker
        asks again); 410 when the worker left meanwhile, the refusal when it was left out."""
        try:
            await asyncio.wait_for(ticket.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            if not ticket.done and self._tickets.get(ticket.ask.worker_id) is ticket:
                del self._tickets[ticket.ask.worker_id]
        if ticket.gone:
            raise unknown_worker(ticket.ask.worker_id)
        if ticket.refused is not None:
            raise ticket.refused
        return ticket.reply

    def ask_of(self, worker: str) -> QuorumAsk:
        return self._tickets[worker].ask

    def since(self, workers: list[str]) -> float:
        """When the earliest of ``workers`` first asked."""
        return min(self._since[w] for w in workers)

    def workers(self) -> tuple[str, ...]:
        """The workers with a request waiting, by id."""
        return tuple(sorted(self._tickets))

    def __bool__(self) -> bool:
        return bool(self._tickets)
