"""How a round on a thread of its own stops the training thread between two inner steps: the
streaming all-reduce payload (``FragmentRounds``) parks the training loop while it rebases the
model on a state received, so the model is never written by both threads at once."""

from __future__ import annotations

import threading


class Park:
    """Lets the round's thread stop the training thread between two inner steps.

    ``hold`` (round's thread) waits until the training thread is parked; ``release`` lets it go.
    ``serve`` (training thread, between steps) parks while a hold is asked for; ``wait`` is
    where the training thread waits for a round to end, parking too if asked meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._wanted = False
        self._parked = False

    @property
    def held(self) -> bool:
        return self._wanted

    def hold(self, timeout: float) -> None:
        """Wait until the training thread is parked; ``QuorumFailed``-worthy ``TimeoutError``
        if it does not come within ``timeout`` seconds (a step longer than that)."""
        with self._cond:
            if self._wanted:
                return
            self._wanted = True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._parked, timeout):
                self._wanted = False
                self._cond.notify_all()
                raise TimeoutError(f"the training loop did not pause within {timeout:.0f} s")

    def release(self) -> None:
        with self._cond:
            self._wanted = False
            self._cond.notify_all()

    def serve(self) -> None:
        """Park here while the round's thread holds the model."""
        with self._cond:
            self._park_if_asked()

    def wait(self, done: threading.Event) -> None:
        """Until ``done`` is set (the round's thread sets it through ``notify``), parking
        whenever asked."""
        with self._cond:
            while not done.is_set():
                if not self._park_if_asked():
                    self._cond.wait()

    def notify(self, done: threading.Event) -> None:
        with self._cond:
            done.set()
            self._cond.notify_all()

    def _park_if_asked(self) -> bool:
        if not self._wanted:
            return False
        self._parked = True
        self._cond.notify_all()
        self._cond.wait_for(lambda: not self._wanted)
        self._parked = False
        return True
