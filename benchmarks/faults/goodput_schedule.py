"""The goodput benchmark's chaos schedule: which fault, to which worker, at which point of training.

A point of training is counted in rounds' worth of inner steps that reached the global model:
fault ``at=k`` fires once ``k * workers * sync_every`` inner steps are in the global model (read
from the server's ``/status``, ``step_ledger.py``), which for the fault-free barrier is the close
of round ``k``. Every configuration (the barrier, async, quorum rounds, the simulated
data-parallel baseline) meets the same faults at the same points of training, whatever its pace;
durations (a freeze) are seconds, the only wall-clock part of the schedule.

The schedule is deterministic: the places (fractions of the run) are fixed, and the seed picks
which workers are hit, so a run's faults can be named before it starts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("kill", "slow", "fast", "freeze", "server")
"""``kill``: SIGKILL a worker, restarted at once under the same id from its last checkpoint;
``slow``: the worker's steps take ``factor`` times as long (a straggler) until ``fast``;
``freeze``: SIGSTOP the worker, SIGCONT ``seconds`` later; ``server``: SIGKILL the server,
restarted at once on its port, resuming from its save dir."""

# Where each fault lands, as a fraction of the run's rounds: a kill early, a straggler for a
# fifth of the run, a freeze past the middle, the server restart late (its checkpoint then holds
# most of the run, and the workers have the most to resync).
PLACES = {"kill": 0.15, "slow": 0.25, "fast": 0.45, "freeze": 0.55, "server": 0.75}


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule."""

    at: int
    """Rounds' worth of inner steps in the global model when it fires (see the module doc)."""
    kind: str
    """One of ``KINDS``."""
    worker: int | None = None
    """The worker slot it hits (None for ``server``)."""
    factor: float = 1.0
    """``slow``: how many times longer each step takes (4: a quarter of the speed)."""
    seconds: float = 0.0
    """``freeze``: how long the worker stays stopped."""
    offset: int = 0
    """``kill``, ``freeze``: the worker's own inner steps between the point ``at`` and the fault,
    so that it lands inside a round (at a round's end a kill would cost nothing, a freeze might
    come after the worker's upload)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.at < 1:
            raise ValueError(f"a fault fires after round 1 at the earliest, not at {self.at}")
        if (self.worker is None) != (self.kind == "server"):
            raise ValueError(
                f"a {self.kind} fault {'names no' if self.kind == 'server' else 'needs a'} worker"
            )

    def describe(self) -> str:
        what = {
            "kill": f"kill -9 worker {self.worker}, restart it",
            "slow": f"worker {self.worker} at 1/{self.factor:g} speed",
            "fast": f"worker {self.worker} back to full speed",
            "freeze": f"SIGSTOP worker {self.worker} for {self.seconds:g} s",
            "server": "kill -9 the server, restart it",
        }[self.kind]
        later = f" +{self.offset} of its steps" if self.offset else ""
        return f"round {self.at}{later}: {what}"


def schedule(
    rounds: int, workers: int, sync_every: int, seed: int, freeze_s: float, slow: float = 4.0
) -> tuple[Fault, ...]:
    """The chaos schedule of a run of ``rounds`` rounds of ``sync_every`` steps with ``workers``
    workers (at least 3, and at least 6 rounds, so every fault has a round of its own): a kill,
    a straggler at ``1/slow`` speed and back, a freeze of ``freeze_s`` seconds, a server restart,
    in that order (``PLACES``); the kill and the freeze half a round into the victim's steps;
    ``seed`` picks three different workers for the kill, the straggler and the freeze."""
    if workers < 3:
        raise ValueError("the chaos schedule hits three different workers: --workers >= 3")
    if rounds < 6:
        raise ValueError("the chaos schedule needs at least 6 rounds (steps / sync_every)")
    victims = random.Random(seed).sample(range(workers), 3)
    at: dict[str, int] = {}
    last = 0
    for kind, place in PLACES.items():
        # Each fault one round after the previous at least, and before the last round.
        at[kind] = min(max(last + 1, round(place * rounds)), rounds - 1)
        last = at[kind]
    kill, slowed, frozen = victims
    half = max(1, sync_every // 2)
    return (
        Fault(at["kill"], "kill", kill, offset=half),
        Fault(at["slow"], "slow", slowed, factor=slow),
        Fault(at["fast"], "fast", slowed),
        Fault(at["freeze"], "freeze", frozen, seconds=freeze_s, offset=half),
        Fault(at["server"], "server"),
    )
