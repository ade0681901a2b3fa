"""All-reduce mode's front (``ServerConfig.allreduce``): what the coordinator hands this mode.
Registrations (the parameter table, ``server/run_table.py``, and the reply's additions),
``POST /quorum`` and ``POST /quorum/outcome`` (``server/quorum.py``), over the same registry,
membership and health checks as server mode. The server holds no parameters here: the workers
average among themselves over a rendezvous the server hosts (``server/rendezvous.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError
from diloco.server.membership import Membership
from diloco.server.model import Model
from diloco.server.quorum import QuorumBook
from diloco.server.quorum_bodies import Ask, Outcome
from diloco.server.registry import WorkerRegistry
from diloco.server.run_table import RunTable
from diloco.server.upload_body import registered_codec

ALLREDUCE_CODECS = ("fp32", "bf16")
"""What a quorum's all-reduce carries. Quantized codes cannot be summed as they are (each
worker's blocks have their own scales), and decoding before the sum would need every member
to quantize identically: the lossy codecs stay with the server mode."""


def server_mode() -> ApiError:
    """409 for ``/quorum`` asked of a server in server mode."""
    return ApiError(
        409,
        "server_mode",
        "this server holds the parameters (it runs without --allreduce): upload "
        "pseudo-gradients to POST /submit_pseudograd instead",
    )


class AllReduce:
    """The quorums (``book``) and the run's parameter table (``table``) of one server life.
    Hooks itself into ``membership`` (a worker that leaves leaves its quorum) and ``model``
    (the round shown is the workers' state's)."""

    def __init__(
        self,
        config: ServerConfig,
        registry: WorkerRegistry,
        membership: Membership,
        model: Model,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.registry = registry
        self.membership = membership
        self.table = RunTable()
        self._comm: dict[str, str] = {}  # worker id -> "fp32" or "bf16", from its registration
        self.book = book = QuorumBook(
            instance=uuid.uuid4().hex[:12],
            live=registry.ids,
            clock=clock,
            min_workers=config.min_workers,
            num_workers=config.num_workers,
            join_timeout=config.join_timeout,
            collective_timeout=config.collective_timeout,
            poll_margin=config.poll_timeout,
            save_every=config.save_every,
            # As the server mode holds a resumed round for the heartbeat timeout.
            resume_grace=config.heartbeat_timeout,
            heartbeat_of=self._heartbeat_of,
        )
        membership.left = book.on_leave
        model.round_source = lambda: book.round

    def _heartbeat_of(self, worker_id: str) -> tuple[float, float] | None:
        """When the server last heard from the worker and its heartbeat interval (0: none, or
        a worker too old to say)."""
        record = self.registry.get(worker_id)
        if record is None:
            return None
        interval = record.info.get("heartbeat_interval", 0)
        ok = isinstance(interval, int | float) and not isinstance(interval, bool)
        return record.last_seen, float(interval) if ok and interval > 0 else 0.0

    def attach(self, address: tuple[str, int], forget: Callable[[str], object]) -> None:
        """The rendezvous is listening at ``address``; ``forget(quorum_id)`` drops a quorum's
        keys from it."""
        self.book.rendezvous = address
        self.book.forget = forget

    def register(
        self, worker_id: str | None, hostname: str, info: dict[str, Any]
    ) -> dict[str, Any]:
        """A registration: its table and codec checked (400 ``missing_params_table``, 409
        ``params_mismatch``, 422 ``codec_refused`` for a lossy codec) before anything changes; the reply tells the worker the mode, the
        rendezvous, the collective timeout, the run's table and the outer optimizer every
        worker must step identically."""
        table = self.table.check(info)
        comm = registered_codec(info, ALLREDUCE_CODECS) or "fp32"
        reply = self.membership.register(worker_id, hostname, info)
        self.table.adopt(table)
        self._comm[str(reply["worker_id"])] = comm
        config = self.config
        reply.update(
            self.book.registration(),
            params=self.table.json(),
            weighting=config.weighting,
            outer={
                "lr": config.outer_lr,
                "momentum": config.outer_momentum,
                "nesterov": config.nesterov,
            },
        )
        return reply

    async def quorum(self, ask: Ask) -> dict[str, Any] | None:
        """``POST /quorum``: the worker's quorum, or None when none formed within
        ``poll_timeout`` (the worker asks again)."""
        ticket = self.book.ask(ask)
        self.registry.touch(ask.worker_id)  # a worker asking is alive, and has joined
        reply = await self.book.wait(ticket, self.config.poll_timeout)
        if reply is not None:
            # bf16 when every member sends bf16, else fp32: one dtype per collective.
            both = all(self._comm.get(m) == "bf16" for m in reply["members"])
            reply["comm"] = "bf16" if both else "fp32"
        return reply

    def outcome(self, outcome: Outcome) -> dict[str, Any]:
        """``POST /quorum/outcome``."""
        reply = self.book.report(outcome)
        self.registry.touch(outcome.worker_id)
        return reply

    def set_num_workers(self, num_workers: int) -> None:
        """The first quorum of a fresh run waits for this many workers."""
        self.book.num_workers = num_workers
        self.book.tick()
