"""StepGate: when a stage service's optimizer steps, and what callers see while it does.

With stage sync (``SwarmPeer(sync_every=H)``) the stage's optimizer carries a ``DiLoCoWorker``
hook, so a step may block for a whole quorum round on the service's compute thread. Three rules
keep the drivers from mistaking that for a dead replica:

- **The reply goes first.** The call whose backward completes a step's samples only marks the
  step due (``mark_due``); its handler replies, then hands the step to the compute thread
  (``run_due``). If another call reaches the compute thread first, it runs the due step itself
  and is then refused with 503 ``syncing`` (the caller waited through the step; it retries), so
  the step always precedes every later call's work, as before.
- **Busy is said, not suffered.** While a step runs, ``busy`` is set and the event loop's
  ``wake`` fires: a call arriving then, or still queued behind the step, is answered 503
  ``syncing`` with ``retry_after`` seconds at once instead of waiting (the driver waits and
  retries, bounded by its busy wait, and never reports the replica suspect).
- **Idle replicas still take part.** ``idle_step`` steps with no gradient (the optimizer skips
  parameters whose ``grad`` is None, so nothing moves) so the DiLoCo hook counts an inner step:
  a replica no driver calls still reaches its stage's rounds, with 0 samples (weight 0 under
  ``--weighting samples``).

``before_step(samples)`` is called on the compute thread just before each step with the samples
the step holds (the peer tells its ``DiLoCoWorker`` through ``report``).

``version`` counts the steps begun, idle ones included: the parameters may have changed in place
since a held forward ran exactly when it moved (``stage_calls.py`` then recomputes that forward).
A step is the one place they change: the optimizer's update, and everything the stage's
``DiLoCoWorker`` does to them (a round's adoption, a joiner's resync), which runs in the
optimizer's post-step hook, inside ``optimizer.step()`` (a streaming round's thread parks the
training thread there too).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch

RETRY_FLOOR_S, RETRY_CAP_S = 0.01, 1.0
"""The ``retry_after`` said while busy: half the last step's duration, within these bounds."""


class StepGate:
    """The stepping of one stage's ``optimizer`` (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        before_step: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.optimizer, self.before_step, self.clock = optimizer, before_step, clock
        self.busy = threading.Event()
        self._due: int | None = None  # samples of a step marked due and not yet run
        self._last_s = 0.0
        self._last_at = clock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.idle_steps = 0  # steps with no gradient (``idle_step``)
        #: Steps begun (module docstring); read and bumped on the compute thread only.
        self.version = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The service's event loop (its handlers wait on ``wait_busy``)."""
        self._loop, self._wake = loop, asyncio.Event()

    # --- the compute thread --------------------------------------------------------------------

    def mark_due(self, samples: int) -> None:
        self._due = samples

    @property
    def due(self) -> bool:
        return self._due is not None

    def run_due(self) -> bool:
        """Run the step marked due, if any; whether one ran."""
        samples = self._due
        if samples is None:
            return False
        self._due = None
        self._step(samples)
        return True

    def idle_step(self) -> None:
        """A step with no gradient (an idle replica's): the hook counts it, nothing moves."""
        self.run_due()
        self.optimizer.zero_grad(set_to_none=True)
        self._step(0)

    def _step(self, samples: int) -> None:
        self._set_busy(True)
        # Bumped before the step: one that raises half way may still have moved parameters.
        self.version += 1
        began = self.clock()
        try:
            if self.before_step is not None:
                self.before_step(samples)
            self.optimizer.step()
            self.optimizer.zero_grad()
        finally:
            self._last_at = self.clock()
            self._last_s = self._last_at - began
            self.idle_steps += samples == 0
            self._set_busy(False)

    def _set_busy(self, on: bool) -> None:
        if on:
            self.busy.set()
        else:
            self.busy.clear()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set if on else wake.clear)

    # --- what callers and the idle timer read ---------------------------------------------------

    def idle_for(self) -> float:
        """Seconds since the last step ended (or since the gate was made)."""
        return self.clock() - self._last_at

    def retry_after(self) -> float:
        return min(max(self._last_s / 2, RETRY_FLOOR_S), RETRY_CAP_S)

    async def wait_busy(self) -> None:
        """Return once a step is running (on the event loop given to ``bind``)."""
        assert self._wake is not None, "bind() the gate to the service's loop first"
        await self._wake.wait()
