"""SIGTERM ends a worker the way Ctrl-C does: the training loop is interrupted by an exception,
and the worker leaves the run on its way out instead of dying registered.

SIGTERM is what schedulers (Slurm, Kubernetes) and ``kill`` send. Its default action kills the
process at once: no deregistration, so a synchronous round waits for the dead worker until the
server evicts it, and the steps since the last sync are lost. ``SigtermExit`` turns the signal
into ``Terminated`` (a ``SystemExit`` with status 143, the shell's code for SIGTERM), raised in
the training thread. Where the signal lands decides what the worker may still send:

- outside a sync (the usual case: a sync is a small share of a step's time) the model holds
  parameters, so the worker hands in its last steps and leaves (``Terminated.clean``);
- inside a sync the model may hold progress instead of parameters, so, like Ctrl-C, it leaves
  without the final upload (an upload the server already counted stays counted).

It is installed only where it cannot surprise anyone: on the main thread (where Python runs
signal handlers), when SIGTERM still has its default action (a program's or a framework's own
handler, Lightning's for one, is left alone), and never in a worker group, whose ranks would
receive the signal at different points and leave through collectives that do not match.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

#: The exit status of a process ended by SIGTERM, as shells report it.
EXIT_STATUS = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """SIGTERM, raised in the training thread by the worker. ``clean``: it landed outside a
    sync, so the model holds parameters and the last local steps may be handed in."""

    def __init__(self, *, clean: bool) -> None:
        super().__init__(EXIT_STATUS)
        self.clean = clean


class SigtermExit:
    """A worker's SIGTERM handler, between ``install`` and ``restore``. ``leave(submit)`` is
    the worker's way out; it runs at interpreter exit when the exception escaped every
    ``with`` and callback (the Hugging Face Trainer calls none on an exception), and must do
    nothing if the worker has left already."""

    def __init__(self, leave: Callable[[bool], None]) -> None:
        self._leave = leave
        self._installed = False
        self._previous: object = signal.SIG_DFL
        self._syncing = 0  # depth of ``syncing`` blocks on the training thread
        self._at_exit: Callable[[], None] | None = None

    def install(self) -> bool:
        """Take SIGTERM if this is the main thread and the signal has its default action."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def restore(self) -> None:
        """Give SIGTERM back its previous action (if the handler is still this one). An
        exit-time leave stays registered (it may be running now): it does nothing once the
        worker has left."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return  # a handler left behind falls back to the default action (``_handle``)
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    @contextmanager
    def syncing(self) -> Iterator[None]:
        """A sync runs: a SIGTERM now must not lead to a final upload."""
        self._syncing += 1
        try:
            yield
        finally:
            self._syncing -= 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._installed:  # the worker left but could not restore from its thread
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        clean = self._syncing == 0
        log.warning(
            "SIGTERM: leaving the run%s",
            " after handing in the last local steps"
            if clean
            else " (inside a sync: no final upload)",
        )
        if self._at_exit is None:
            self._at_exit = lambda: self._leave(clean)
            atexit.register(self._at_exit)
        raise Terminated(clean=clean)
