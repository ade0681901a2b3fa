"""How a worker syncs: the interface between ``DiLoCoWorker``'s lifecycle and a sync strategy.

The lifecycle sees each optimizer step, registers, fetches the first parameters and leaves; a
strategy decides when the model is exchanged and how (``PlainSync``: the whole model every
``sync_every`` steps; ``StreamingSync``: one fragment at a time, overlapped with training). A
strategy works on the ``Session`` and ``LocalModel`` it is given, never on the worker.

Every method is called on the training thread (inside ``optimizer.step()``, ``force_sync``,
``start`` or ``stop``), one at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from diloco.worker.session import Session


@dataclass(frozen=True)
class JoinAnswer:
    """What a re-registration says about this worker's last upload (``last_submission``)."""

    seeded: bool  # the server had no parameters and took this worker's own (progress included)
    in_params: bool  # the upload is in the parameters the server serves
    held_open: bool  # counted in a round still open: the server holds it in memory only

    @classmethod
    def of(cls, reply: Mapping[str, Any], *, seeded: bool) -> JoinAnswer:
        last = reply.get("last_submission") or {}
        in_params = bool(last.get("in_params"))
        return cls(seeded, in_params, last.get("counted_in") is not None and not in_params)


class SyncStrategy(Protocol):
    """When and how a worker exchanges its model with the server."""

    @property
    def last_submission(self) -> str | None:
        """The id of the upload a re-join asks the server about: one it may hold whose result
        this worker has not adopted; None if there is none."""
        ...

    @property
    def round(self) -> int:
        """The round shown as ``sync_metrics["round"]``: the oldest this worker trains on."""
        ...

    def configure(self, reply: Mapping[str, Any]) -> None:
        """Take what a register or initial-params reply says about syncing (mode, fragment
        plan and rounds). Called before any download of a join; raises ValueError on a plan
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

    def after_step(self) -> None:
        """One inner step was taken (``session.local_step`` and ``total_steps`` counted it):
        sync if one is due, or re-join if ``session.need_rejoin`` is set. Never raises a network
        error: failures are logged, counted in the metrics, and training goes on locally."""
        ...

    def sync_now(self) -> None:
        """Sync the whole model now, whatever the step count (``force_sync``), waiting for the
        result. Never raises a network error."""
        ...

    def finish(self, *, submit: bool) -> None:
        """The worker is leaving: end what is in flight and, with ``submit``, hand in the local
        steps not yet sent, without waiting for their round. May raise ``Unreachable`` or
        ``ServerError``; the worker then logs it and leaves anyway."""
        ...


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
