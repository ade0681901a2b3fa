"""Claim p (MuLoCo, benchmarks/quality/muon.py): the experiment's configurations and the verdict
by the rule the page prints, on made-up results."""

from __future__ import annotations

import pytest
from benchmarks.quality.claims import CLAIMS
from benchmarks.quality.experiments import DEFAULT, FAST, replace
from benchmarks.quality.muon import NOT_REPRODUCED, REPRODUCED, claim_p, muon, name
from benchmarks.quality.rules import RULES, rule_text


def test_every_m_shares_one_global_batch_and_both_inner_optimizers_run() -> None:
    configs = muon(DEFAULT)
    got = [(c.inner, c.workers, c.batch_size) for c in configs]
    assert got == [(i, m, 32 // m) for i in ("adamw", "muon") for m in (1, 4, 8)]
    assert {c.steps for c in configs} == {DEFAULT.steps} and len(muon(FAST)) == 4
    with pytest.raises(ValueError, match="does not split"):
        muon(replace(FAST, muon_batch=3))


def _results(adamw: dict[int, list[float]], mu: dict[int, list[float]]) -> dict:
    rows = []
    for inner, losses in (("adamw", adamw), ("muon", mu)):
        for m, per_seed in losses.items():
            rows += [
                {"name": name(inner, m), "seed": s, "eval_loss": x, "config": {"workers": m}}
                for s, x in enumerate(per_seed)
            ]
    return {"muon": {"rows": rows}}


def test_claim_p_holds_when_muon_degrades_less_at_the_largest_m_in_every_seed() -> None:
    """Degradation is loss at M minus loss at M = 1, paired by seed; Muon's must be below
    AdamW's at the largest M in every seed (at M = 4 it is only reported)."""
    adamw = {1: [2.0, 2.0], 4: [2.1, 2.1], 8: [2.3, 2.2]}
    ours, verdict, note = claim_p(_results(adamw, {1: [2.1, 2.1], 4: [2.3, 2.1], 8: [2.2, 2.2]}))
    assert verdict == REPRODUCED, ours
    assert "M=8: AdamW +0.250 ± 0.071, Muon +0.100 ± 0.000" in ours
    assert "Muon − AdamW at M=1: +0.100" in note
    # One seed where Muon degrades more than AdamW: not reproduced.
    worse = {1: [2.1, 2.1], 4: [2.1, 2.1], 8: [2.2, 2.4]}
    assert claim_p(_results(adamw, worse))[1] == NOT_REPRODUCED


def test_claim_p_is_a_row_of_the_table_and_its_rule_is_printed() -> None:
    row = next(c for c in CLAIMS if c[0] == "p")
    assert row[1] == "muon" and row[4] is claim_p
    # Its rule is a row of the one table (rules.py), so the page prints what claim_p applies.
    (check,) = RULES["p"]
    assert (check.test, check.paired) == ("less", True)
    assert rule_text("p") == (
        "Muon's loss at the largest M minus its loss at M=1: smaller than AdamW's same "
        "difference in every seed (paired by seed)."
    )
