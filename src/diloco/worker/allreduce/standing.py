"""All-reduce mode on the worker: its standing with the server's quorums, as the server's refusals
set it (docs/design/allreduce.md, "Protocol detail", ``POST /quorum``), and what the quorum loop
(``quorum_sync.py``) does about each.

- 409 ``unagreed_state``: the state this worker presented is not one the run agreed on. It asks
  again at once presenting none (``disowned``), keeping its progress: the quorum then hands it
  the run's state and it rebases on it.
- 409 ``left_out``, action ``continue`` (blamed for quorums failing at their joins): no quorum
  this sync, training goes on alone and it asks again at its next sync.
- 409 ``left_out``, action ``rejoin`` (the checks excluded it too often): the same, and it
  registers again before its next quorum, presents no state and contributes weight 0 to that
  round (``restarting``); the state received replaces its whole model (``Payload.take_state``).
- 410: the server forgot it (evicted, restarted): it registers again and goes on.

A leave is logged once, however many syncs it lasts.
"""

from __future__ import annotations

import logging

from diloco.worker.session import Session
from diloco.worker.transport.client import Conflict

log = logging.getLogger(__name__)


class Standing:
    """What the server's refusals told this worker, until a quorum round settles it."""

    def __init__(self, session: Session) -> None:
        self._s = session
        # The server refused the state this worker presented (``unagreed_state``), or it must
        # take the run's (``rejoin``): it presents none until it receives the run's, keeping
        # its progress on top (the model still holds full parameters, not progress).
        self.disowned = False
        # Left out until it registers again: its next round takes the run's state in place of
        # its own and contributes weight 0.
        self.restarting = False
        self._said = False  # the leave's warning is logged once

    def rejoin_if_forgotten(self) -> None:
        """Register again when the server forgot this worker (a 410, or ``rejoin``)."""
        s = self._s
        if s.need_rejoin.is_set():
            s.rejoin()
            s.need_rejoin.clear()

    def refused(self, exc: Conflict, *, presented: bool) -> bool:
        """A 409 to the quorum request: True when it is ``unagreed_state`` for a state
        ``presented``: the next request presents none (logged). Otherwise the caller raises."""
        if exc.code != "unagreed_state" or not presented:
            return False
        log.warning(
            "worker %s: %s; asking again with no state (its progress is kept)",
            self._s.worker_id,
            exc.detail,
        )
        self.disowned = True
        return True

    def left_out(self, exc: Conflict) -> None:
        """409 ``left_out``: no quorum this sync, training goes on alone (logged once per
        leave). With action ``rejoin`` it registers again before its next quorum, and that
        quorum gives it the run's state."""
        s = self._s
        if exc.reply.action == "rejoin":
            s.need_rejoin.set()
            self.restarting = self.disowned = True
        if not self._said:
            self._said = True
            log.warning("worker %s: %s; training goes on alone", s.worker_id, exc.detail)

    def received(self) -> None:
        """The run's state arrived: this worker holds an agreed state again."""
        self.disowned = False

    def completed(self) -> None:
        """A round completed with this worker: a leave that ended is over."""
        self.restarting = self._said = False
