"""How a server-mode strategy joins and re-joins (docs/design/durability.md, "Worker state and
rebasing"):
the server's parameters, seeded from this worker's own when it has none, fetched into the
snapshot; on a re-join, the local progress kept on top unless the server says it holds it.

The steps are the same for ``PlainSync`` and ``StreamingSync``; what differs between them (the
fragment plan and rounds, which uploads go again) is the ``Joining`` interface below, which
both implement and call ``join_server``/``rejoin_server`` with.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from diloco.wire.messages import LastSubmission, ParamsSeeded, Registered
from diloco.worker.session import Session
from diloco.worker.transport.client import Conflict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinAnswer:
    """What a re-registration says about this worker's last upload (``last_submission``)."""

    seeded: bool  # the server had no parameters and took this worker's own (progress included)
    in_params: bool  # the upload is in the parameters the server serves
    held_open: bool  # counted in a round still open: the server holds it in memory only

    @classmethod
    def of(cls, last: LastSubmission | None, *, seeded: bool) -> JoinAnswer:
        if last is None:
            return cls(seeded, False, False)
        return cls(seeded, last.in_params, last.counted_in is not None and not last.in_params)


class Joining(Protocol):
    """What a server-mode strategy adds to the common join and re-join."""

    def configure(self, reply: Registered | ParamsSeeded) -> None:
        """Take what a register or initial-params reply says about syncing (the fragment plan
        and rounds). Called before any download of a join; raises ValueError on a plan
        that does not fit the model."""
        ...

    def joined(self, metadata: Mapping[str, str]) -> None:
        """The first full download of ``start()`` is in the snapshot (``metadata`` is its
        header's); the model takes it right after. Raises ValueError if the server syncs in a
        way this strategy cannot follow."""
        ...

    def rejoined(self, answer: JoinAnswer) -> str:
        """A re-registration succeeded: fetch the parameters the server serves into the model,
        dropping the progress ``answer`` says they hold and keeping the rest on top (a rebase),
        and settle which uploads go again under their ids. Returns how the last upload was
        settled, for the log. A network error leaves the model as ``LocalModel.refresh`` says
        and ``last_submission`` unchanged."""
        ...


def join_server(s: Session, strategy: Joining, reply: Registered) -> None:
    """``SyncStrategy.join`` in server mode: seed the server if it has no parameters, fetch
    them into the snapshot, and the model takes them."""
    _seed(s, strategy, reply)
    s.fetch(0)
    strategy.joined(s.last_metadata)
    s.local.adopt_all()


def rejoin_server(s: Session, strategy: Joining, reply: Registered) -> str:
    """``SyncStrategy.rejoin`` in server mode. The model holds its local progress; the strategy
    adds it back unless the server says its last upload is already in the parameters."""
    seeded = _seed(s, strategy, reply)
    # Only an upload whose result we never adopted can be inside the model's progress.
    s.full_next = True
    return strategy.rejoined(JoinAnswer.of(reply.last_submission, seeded=seeded))


def _seed(s: Session, strategy: Joining, reply: Registered) -> bool:
    """Check the server's parameter table, configure the strategy, and upload this model as
    the initial parameters if the server has none. True if this worker's were taken."""
    if reply.params is not None:
        s.local.check_server_table(reply.params)
    s.weighting = reply.weighting
    strategy.configure(reply)
    if reply.has_params:
        return False
    assert s.worker_id is not None
    try:
        seeded = ParamsSeeded.from_json(s.client.upload_initial(s.worker_id, s.local.detached()))
    except Conflict:
        return False  # another worker was first
    log.info("worker %s provided the initial parameters", s.worker_id)
    strategy.configure(seeded)
    return True


def note_lost_adoption(
    session: Session, answer: JoinAnswer, resend: str | None, steps: int
) -> None:
    """A download broke off inside the model, then the server lost the round: the progress it
    overwrote is gone. Only a server without --save-every 1 does that."""
    local = session.local
    if (
        local.holds_progress
        and local.progress_counted
        and not (answer.seeded or answer.in_params or resend)
    ):
        session.drop_steps(
            steps,
            "worker %s: the server lost an upload (%d local steps) whose result this worker "
            "had begun to adopt; those steps are dropped",
            steps,
            error=True,
        )
