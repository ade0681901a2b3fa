"""What a joined swarm peer does after its heartbeats when the coordinator's view of it changed.

- **Forgotten** (410 on a heartbeat: the server restarted, or evicted the peer): the peer
  registers again under its own id asking for ITS stage only (``info.stages=[k]``), so the
  coordinator cannot hand it another one, and says ready again with its table and address.
  Nothing of the data plane stops meanwhile: its service keeps answering drivers, which keep
  their last route table while the coordinator is away (``CoordinatorRoutes``).
- **Registered again by its stage sync**: the peer's ``DiLoCoWorker`` registers again on its own
  when a quorum call gets a 410 (``worker.py``'s ``_rejoin``, asking for the same stage through
  ``DiLoCoWorker(stages=)``). A registration takes the peer out of the route table until it says
  ready again, so after each such re-registration (the worker's ``reconnections`` grew) the
  peer says ready again at its next heartbeat.

A step that fails (the coordinator unreachable again) is logged and retried at the next
heartbeat: the peer stays what it was. Heartbeat threads and tests calling ``SwarmPeer.beat``
may both get here; one lock keeps one of them at a time.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from diloco.wire.messages import Registered, RegisterInfo
from diloco.wire.messages.codec import MessageError
from diloco.worker.transport.client import SYNC_FAILURES

if TYPE_CHECKING:
    from diloco.swarm.peer import SwarmPeer

log = logging.getLogger(__name__)


class PeerLife:
    """The peer's answers to what its heartbeats learned (``after_beat``)."""

    def __init__(self, peer: SwarmPeer) -> None:
        self.peer = peer
        self._lock = threading.Lock()
        self._lost = False
        #: The stage worker's ``reconnections`` when the peer last said ready.
        self._ready_at = self._reconnections()
        #: Times the peer registered again after a 410 and said ready (observation, tests).
        self.rejoins = 0

    def _reconnections(self) -> int:
        worker = self.peer.worker
        return 0 if worker is None else int(worker.metrics["reconnections"])

    def said_ready(self) -> None:
        """The peer said ready (at start, or again): a worker's earlier re-registration is
        answered."""
        self._ready_at = self._reconnections()

    def after_beat(self, lost: bool) -> None:
        """After a heartbeat; ``lost``: it got 410 (the coordinator does not know the peer)."""
        if self.peer.stopping:
            return
        with self._lock:
            try:
                if lost or self._lost:
                    self._lost = True
                    self._register_again()
                    self._lost = False
                    self.rejoins += 1
                elif self._reconnections() != self._ready_at:
                    self.peer._say_ready()
            except (*SYNC_FAILURES, MessageError, ValueError) as exc:
                log.warning("swarm peer %s: rejoin failed (next heartbeat tries again): %s",
                            self.peer.worker_id, exc)  # fmt: skip

    def _register_again(self) -> None:
        peer = self.peer
        assert peer.worker_id is not None and peer.stage is not None
        info = RegisterInfo(
            pid=os.getpid(), heartbeat_interval=peer.heartbeat_interval, stages=(peer.stage,)
        )
        reg = Registered.from_json(peer.client.register(peer.worker_id, info=info))
        if reg.stage != peer.stage:  # a coordinator that ignored ``stages``: not ours to serve
            raise ValueError(f"registered again for stage {peer.stage}, given {reg.stage}")
        log.warning(
            "swarm peer %s: the coordinator had forgotten it; registered again for stage %d",
            peer.worker_id, peer.stage,
        )  # fmt: skip
        peer._say_ready()
