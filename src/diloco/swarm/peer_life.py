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

Its end: a serving peer leaves at ``stop()`` or SIGTERM (``serve_until_stopped``), also where
its stage worker took SIGTERM first.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch import nn

from diloco.persistence.folders import Checkpoint
from diloco.persistence.reading import latest_checkpoint
from diloco.wire.messages import HeartbeatReply, Registered, RegisterInfo
from diloco.wire.messages.codec import MessageError
from diloco.worker.termination import Terminated
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
        #: Moves to another stage done, and why the last one could not serve (if it could not).
        self.moves = 0
        self.unrestorable: str | None = None

    def _reconnections(self) -> int:
        worker = self.peer.worker
        return 0 if worker is None else int(worker.metrics["reconnections"])

    def said_ready(self) -> None:
        """The peer said ready (at start, or again): a worker's earlier re-registration is
        answered."""
        self._ready_at = self._reconnections()

    def after_beat(self, reply: HeartbeatReply | None) -> None:
        """After a heartbeat; ``reply`` None: it got 410 (the coordinator does not know the
        peer)."""
        if self.peer.stopping:
            return
        with self._lock:
            try:
                if reply is not None and reply.move_to is not None:
                    self._move(reply.move_to)
                elif reply is None or self._lost:
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

    def _move(self, stage: int) -> None:
        """The coordinator moved the peer to ``stage`` (its last replica left): stop serving the
        old one (still registered), register again for the new one, build it, restore it from
        its newest checkpoint (with stage sync, its worker starts from the checkpoint's round,
        snapshot and momentum: ``StartState``), serve it and say ready. A stage with agreed
        rounds and no usable checkpoint is not served (``Unrestorable``, or the checkpoint's
        ValueError: logged; the stage stays empty)."""
        peer = self.peer
        assert peer.worker_id is not None
        log.warning("swarm peer %s: moved from stage %s to stage %d",
                    peer.worker_id, peer.stage, stage)  # fmt: skip
        peer._drop_stage()
        info = RegisterInfo(
            pid=os.getpid(), heartbeat_interval=peer.heartbeat_interval, stages=(stage,)
        )
        reg = Registered.from_json(peer.client.register(peer.worker_id, info=info))
        try:
            peer._take_stage(reg, restore=True)
        except (Unrestorable, ValueError) as exc:
            self.unrestorable = str(exc)
            log.error("swarm peer %s: %s", peer.worker_id, exc)
            return
        peer._say_ready()
        peer._start_idler()
        self.moves += 1


class Unrestorable(RuntimeError):
    """A stage with agreed rounds and no checkpoint to restore it from: serving fresh weights
    would pass them off as the stage's agreed state."""


def restore_stage(
    module: nn.Module, restore_dir: str | None, stage: int, *, agreed_rounds: int
) -> Checkpoint | None:
    """Load the newest checkpoint under ``<restore_dir>/stage-<stage>/`` into ``module``, and
    return it (None: none found, which only a stage that never agreed a round may go on with:
    ``Unrestorable`` otherwise). A checkpoint missing a parameter of the module is an error."""
    folder = None if restore_dir is None else Path(restore_dir) / f"stage-{stage}"
    found = None if folder is None else latest_checkpoint(folder)
    if found is None:
        if agreed_rounds > 0:
            raise Unrestorable(
                f"stage {stage} agreed {agreed_rounds} round(s) and no checkpoint of it is under "
                f"{folder}: not served (set restore_dir, or the stage sync's save_dir, to where "
                "its quorums save)"
            )
        return None
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in found.params:
                raise ValueError(f"{found.path} holds no {name!r} of stage {stage}")
            p.copy_(found.params[name])
    log.info("stage %d restored from %s (round %d)", stage, found.path, found.round)
    return found


def serve_until_stopped(stopped: threading.Event) -> None:
    """Block until ``stopped`` is set or SIGTERM arrives; the caller then leaves. A peer with
    stage sync started its ``DiLoCoWorker`` on the main thread, whose SIGTERM handling
    (``worker/termination.py``) was installed first and raises ``Terminated`` here: it is
    caught, so the peer leaves the same way as by its own handling (``stop()``: deregistered,
    its stage's quorums no longer wait for it) and ``diloco swarm-peer`` exits 0, not 143."""
    try:
        with on_sigterm(stopped.set):
            stopped.wait()
    except Terminated:
        log.warning("SIGTERM (taken by the stage worker): the swarm peer leaves")


@contextmanager
def on_sigterm(callback: Callable[[], None]) -> Iterator[None]:
    """SIGTERM calls ``callback`` (the peer leaves cleanly) while inside; only on the main
    thread and only where SIGTERM has its default action (as the worker's handling does)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM: the swarm peer leaves")
        callback()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
