"""Claim q (quorum rounds with a straggler, benchmarks/quality/quorum.py): the experiment's
configurations and the verdict by the printed rule, on made-up results; the plan's wall time of
rows that sleep, counted by hand."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.quality.claims import CLAIMS
from benchmarks.quality.experiments import DEFAULT, FAST
from benchmarks.quality.quorum import (
    BARRIER,
    NOT_REPRODUCED,
    QUORUM,
    REPRODUCED,
    claim_q,
    quorum,
)
from benchmarks.quality.rules import MATCH, RULES, rule_text
from benchmarks.quality.run import slept
from benchmarks.quality.tuning import lr_kind


def test_the_rows_share_one_budget_with_one_straggler_and_differ_only_in_the_quorum() -> None:
    barrier, q = quorum(DEFAULT)
    assert (barrier.name, q.name) == (BARRIER, QUORUM)
    for c in (barrier, q):
        assert c.workers == 4 and c.shared_budget and c.steps == 4 * DEFAULT.steps
        assert c.delays == (0.05, 0.05, 0.05, 0.2) and not c.clock
        assert lr_kind(c) == "diloco"  # the reference M's swept lr, like every DiLoCo variant
    assert barrier.server == {}
    assert q.server == {"quorum": "3", "grace": "auto", "upload_slots": 2}
    assert replace(q, server={}, name=BARRIER) == barrier
    assert quorum(FAST)[0].delays == (0.001, 0.001, 0.001, 0.004)


def _row(name: str, seed: int, loss: float, wall: float, late: int = 0) -> dict:
    straggler = {"steps": 20, "late_merges": late, "refused_submissions": 0}
    return {
        "name": name,
        "seed": seed,
        "eval_loss": loss,
        "wall_s": wall,
        "steps": 100,
        "workers": [{"steps": 25}] * 3 + [straggler],
    }


def _results(extra: list[float]) -> dict:
    rows = []
    for seed, x in enumerate(extra):
        rows += [_row(BARRIER, seed, 2.0, 100.0), _row(QUORUM, seed, 2.0 + x, 60.0, late=4)]
    return {"quorum": {"rows": rows}}


def test_claim_q_holds_when_the_quorum_costs_at_most_match_on_average() -> None:
    ours, verdict, note = claim_q(_results([0.01, 0.02]))
    assert verdict == REPRODUCED, ours
    assert "+0.015 ± 0.007" in ours and "0.60x the barrier's wall time" in ours, ours
    assert "4.0 uploads merged late, 0.0 refused, 20% of the steps" in note, note
    assert claim_q(_results([0.01, 0.04]))[1] == NOT_REPRODUCED  # mean 0.025 > MATCH


def test_claim_q_is_a_row_of_the_table_and_its_rule_is_printed() -> None:
    row = next(c for c in CLAIMS if c[0] == "q")
    assert row[1] == "quorum" and row[4] is claim_q
    (check,) = RULES["q"]
    assert (check.test, check.paired, check.threshold) == ("within", True, MATCH)
    assert rule_text("q") == (
        "quorum 3 of 4, auto grace: a mean difference from the barrier of at most "
        f"+{MATCH} nats per byte (paired by seed)."
    )


def test_the_plan_charges_sleeping_rows_by_their_slowest_or_joint_pace() -> None:
    """Barrier: 40 steps, 10 per worker at the straggler's 0.4 + 0.1 s: 5 s. Quorum: the four
    paces 0.2, 0.2, 0.2 and 0.5 s give 17 steps per second together: 40 / 17 s."""
    barrier, q = (replace(c, delays=(0.1, 0.1, 0.1, 0.4)) for c in quorum(FAST))
    assert slept(barrier, 40, 0.1) == 5.0
    assert abs(slept(q, 40, 0.1) - 40 / 17) < 1e-12
