"""chaos_allreduce's fault schedule: how many faults, of which kind, and when, in training time.

The schedule's clock is training time, not the script's: it starts once every first worker has
joined the run (``FaultClock.begin``), so the seconds a loaded machine spends starting processes
and joining (46 s at load 10, longer than the smoke's whole run) move the faults instead of
swallowing them. The faults themselves are planned up front from the seed (``plan``): the first
``--first-fault`` seconds into training, each next one ``--fault-min`` to ``--fault-max`` seconds
after the previous one was dealt with (a kill, its replacement started; or the server's restart),
as many as fit before ``--duration - --settle`` when none takes any time. Dealing with a fault
takes time (an aimed kill waits for an open quorum, a restart for the server), more under load,
so the run ends ``--settle`` seconds after its last fault at the earliest (``FaultClock.end``):
every planned fault fires, whatever the load, and the same seed fires the same ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    wait: float
    """Seconds of training before it: after training began (the first fault), or after the
    previous fault was dealt with."""
    server: bool
    """Kill the server (True) or a worker (False)."""


def plan(
    seed: int,
    first: float,
    gap_min: float,
    gap_max: float,
    until: float,
    server_share: float,
) -> tuple[Fault, ...]:
    """The faults of a run seeded ``seed``: the first ``first`` seconds into training, each next
    one ``gap_min``-``gap_max`` seconds after the previous one, while the sum of the waits stays
    below ``until`` (the end of the faults, in training seconds); each kills the server with
    probability ``server_share``. Its own random stream, apart from the victims' draws."""
    if gap_min <= 0 or gap_max < gap_min:
        raise ValueError(f"fault gaps need 0 < min <= max, not {gap_min}-{gap_max}")
    rng = random.Random(f"chaos_allreduce faults {seed}")
    faults: list[Fault] = []
    wait, at = first, first
    while at < until:
        faults.append(Fault(wait, rng.random() < server_share))
        wait = rng.uniform(gap_min, gap_max)
        at += wait
    return tuple(faults)


class FaultClock:
    """Which planned fault is due, on the training clock (times: ``time.monotonic()`` values)."""

    def __init__(self, faults: tuple[Fault, ...], duration: float, settle: float) -> None:
        self.pending = list(faults)
        self.duration, self.settle = duration, settle
        self.began: float | None = None  # when training began
        self._since: float | None = None  # the moment the next fault's wait runs from
        self._last: float | None = None  # when the last fault was dealt with

    def begin(self, t: float) -> None:
        """Training began at ``t`` (every first worker joined); later calls change nothing."""
        if self.began is None:
            self.began = self._since = t

    def due(self, t: float) -> Fault | None:
        """The next fault if its wait is over at ``t`` (taken off the plan), else None; the
        caller deals with it, then calls ``dealt_with``."""
        if self._since is None or not self.pending or t - self._since < self.pending[0].wait:
            return None
        return self.pending.pop(0)

    def dealt_with(self, t: float) -> None:
        """The fault just taken was dealt with at ``t``: the next one's wait runs from here."""
        self._since = self._last = t

    def end(self) -> float | None:
        """When the run stops: ``duration`` seconds into training, and ``settle`` seconds after
        the last fault at the earliest; None while training has not begun or faults remain."""
        if self.began is None or self.pending:
            return None
        end = self.began + self.duration
        return end if self._last is None else max(end, self._last + self.settle)


def victims(live: Sequence[T], holds: Callable[[T], bool]) -> list[T]:
    """The live workers a kill may choose from without losing the run: in all-reduce mode the
    model lives only in the members, so a kill must leave at least one live worker holding it
    (one that has completed a sync). With two holders or more, any; with one, only workers
    not holding it (replacements still joining); with none (nothing trained yet), any. Empty:
    wait for a replacement to catch up. (Killing every holder before a replacement caught up
    restarted the run from its first round: the smoke saw every round reached twice.)"""
    holders = [w for w in live if holds(w)]
    if len(holders) != 1:
        return list(live)
    return [w for w in live if not holds(w)]
