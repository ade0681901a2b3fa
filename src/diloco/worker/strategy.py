"""How a worker syncs: the interface between ``DiLoCoWorker``'s lifecycle and a sync strategy.

The lifecycle sees each optimizer step, registers, and leaves; a strategy decides how the model
takes the run's state when the worker joins, and when and how it is exchanged after. One
strategy is chosen per worker, once, from its settings and the server's first registration
reply (``worker/choose.py``): a parameter server's ``PlainSync`` (the whole model every
``sync_every`` steps) or ``StreamingSync`` (one fragment at a time, overlapped with training),
in ``server_mode/``; all-reduce mode's ``QuorumSync``, in ``allreduce/``; a worker group wraps
either in ``GroupSync`` (``groups/``). A strategy works on the ``Session`` and ``LocalModel`` it
is given, never on the worker.

Every method is called on the training thread (inside ``optimizer.step()``, ``force_sync``,
``start`` or ``stop``), one at a time.
"""

from __future__ import annotations

from typing import Protocol

from diloco.wire.messages import Registered


class SyncStrategy(Protocol):
    """When and how a worker exchanges its model with the run."""

    @property
    def last_submission(self) -> str | None:
        """The id of the upload a re-join asks the server about: one it may hold whose result
        this worker has not adopted; None if there is none."""
        ...

    @property
    def round(self) -> int:
        """The round shown as ``sync_metrics["round"]``: the oldest this worker trains on."""
        ...

    def join(self, reply: Registered) -> None:
        """The first registration succeeded (``reply`` is the server's answer, ``worker_id`` set
        in the session): bring the model to the run's state, so training starts from it (the
        server's parameters, seeded from this model if it had none; all-reduce mode: the state
        a quorum holds). Raises ValueError if the run syncs in a way this strategy cannot
        follow, and network errors: the worker then leaves and ``start()`` raises."""
        ...

    def rejoin(self, reply: Registered) -> str:
        """A re-registration succeeded (the server restarted or forgot this worker): reconcile
        the model with what the run holds now, keeping the local progress it does not hold
        (a rebase), and settle which uploads go again under their ids. Returns how the last
        upload was settled, for the log. A network error leaves the model as
        ``LocalModel.refresh`` says and ``last_submission`` unchanged."""
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
