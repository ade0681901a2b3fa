"""Quorum rounds with a straggler (issue 31's quality target, a row of issue 32's suite): its
experiment and its claim.

Four workers share one budget of inner steps; three sleep ``Scale.quorum_unit`` seconds after
each step and the fourth four times that, on top of the step's compute (real sleeps, not the
simulated clock: the quorum's grace window is a real-time timer on the server, so the arrival
order, and with it the loss, depends on the threads, as the old async rows did). Behind the
full barrier every round waits for the straggler, so each worker takes a quarter of the steps;
with ``--quorum 3 --grace auto`` a round closes on the three fast workers plus the adaptive grace
window, the straggler's upload is merged into a later round weighted 1/sqrt(1 + lateness), and
the fast workers take more of the budget. The claim: at equal total inner steps the quorum costs
almost nothing in loss (issue 31: at most +0.02 nats per byte), while its wall time is shorter.
"""

from __future__ import annotations

import statistics

from benchmarks.quality.experiments import Config, Scale, plain
from benchmarks.quality.rules import decide
from benchmarks.quality.stats import Results, fmt, paired, rows

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
RATIO = (1.0, 1.0, 1.0, 4.0)  # the straggler sleeps four times as long after each step
BARRIER, QUORUM = "barrier (every worker, every round)", "quorum 3 of 4, auto grace"


def quorum(s: Scale) -> list[Config]:
    """Claim q: the full barrier against quorum rounds (3 of 4, adaptive grace, late uploads
    merged within one round) with one worker at a quarter of the others' speed, the same total
    inner steps (4 x ``s.steps``) shared by whoever takes them. Two upload slots, as the README
    advises for quorum rounds (a slow body must not hold the only one)."""
    common = {
        "workers": len(RATIO),
        "delays": tuple(s.quorum_unit * r for r in RATIO),
        "steps": s.steps * len(RATIO),
        "shared_budget": True,
    }
    server = {"quorum": "3", "grace": "auto", "upload_slots": 2}
    return [plain(s, BARRIER, **common), plain(s, QUORUM, server=server, **common)]


def claim_q(results: Results) -> tuple[str, str, str]:
    """Ours, verdict and note of claim q by its rule (``rules.RULES["q"]``)."""
    res = results["quorum"]
    diffs = paired(res, QUORUM, BARRIER)

    def wall(name: str) -> float:
        return statistics.mean(r["wall_s"] for r in rows(res, name))

    def straggler(key: str) -> float:
        return statistics.mean(r["workers"][-1].get(key, 0) for r in rows(res, QUORUM))

    text = (
        f"quorum − barrier: {fmt(diffs, signed=True)} nats per byte at "
        f"{wall(QUORUM) / wall(BARRIER):.2f}x the barrier's wall time"
    )
    share = statistics.mean(r["workers"][-1]["steps"] / r["steps"] for r in rows(res, QUORUM))
    note = (
        f"straggler under quorum: {straggler('late_merges'):.1f} uploads merged late, "
        f"{straggler('refused_submissions'):.1f} refused, {share:.0%} of the steps"
    )
    return text, REPRODUCED if decide("q", [diffs]) else NOT_REPRODUCED, note
