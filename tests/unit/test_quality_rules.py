"""The quality suite's verdict rules (issue 32): one table (``benchmarks/quality/rules.py``) from
which both the verdicts and the page's rule sentences come. Made-up results, no training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks.quality import claims, render, rules
from benchmarks.quality.claims import CLAIMS, NOT_REPRODUCED, REPRODUCED, claim_c
from benchmarks.quality.experiments import FAST as SCALE
from benchmarks.quality.protocol import FAST
from benchmarks.quality.rules import GENTLE, MATCH, RULES, Check, decide, rule_text


def _row(name: str, seed: int, loss: float) -> dict[str, Any]:
    """A result row with what the page's tables and plots read."""
    point = {"steps_per_worker": 10, "bytes_up": 0, "wall_s": 1.0, "eval_loss": loss}
    return {
        "name": name,
        "seed": seed,
        "eval_loss": loss,
        "wall_s": 1.0,
        "curve": [point],
        "config": {"workers": 1, "name": name},
    }


def _sync_every(h_losses: dict[int, list[float]], adamw: float = 9.0) -> dict[str, Any]:
    """A ``sync_every`` result: per H its losses over seeds 0, 1, and one-worker AdamW."""
    rows = [_row(f"H={h}", s, x) for h, xs in h_losses.items() for s, x in enumerate(xs)]
    rows += [_row("AdamW, 1 worker (equal steps)", s, adamw) for s in (0, 1)]
    return {"sync_every": {"experiment": "sync_every", "rows": rows}}


def test_every_claim_has_a_rule_and_the_page_prints_it(tmp_path: Path) -> None:
    """The rendered page's claims table carries, in each claim's row, the rule ``rule_text``
    words from the same table the verdicts read; the thresholds in the sentences are the
    table's."""
    assert [c[0] for c in CLAIMS] == list(RULES)
    results = _sync_every({10: [2.0, 2.0], 40: [2.01, 2.01]})
    res = results["sync_every"]
    res.update(fast=False, seeds=[0, 1], command="c", what="w", doc="d")
    res.update(profile=dataclasses.asdict(FAST), scale=dataclasses.asdict(SCALE))
    (tmp_path / "sync_every.json").write_text(json.dumps(res))
    page = render.render(tmp_path, tmp_path / "docs").read_text()
    rows = {line[2]: line for line in page.splitlines() if line[:2] == "| " and line[3:5] == ". "}
    assert list(rows) == list(RULES)
    for letter, line in rows.items():
        assert f" | {rule_text(letter)} | " in line, letter
    assert f"at most +{GENTLE} nats" in rule_text("c") and f"at most +{MATCH}" in rule_text("o")


def test_claim_c_is_judged_by_the_rule_the_page_states() -> None:
    """c: mean loss never falls as H grows, and the largest H within GENTLE of the smallest
    (paired). Beating one-worker AdamW, the old code's unstated rule, no longer decides it."""
    gentle = {5: [2.00, 2.02], 10: [2.01, 2.03], 40: [2.04, 2.06]}
    ours, verdict, note = claim_c(_sync_every(gentle, adamw=1.0))  # AdamW far better: irrelevant
    assert verdict == REPRODUCED, (ours, note)
    steep = {5: [2.00, 2.02], 10: [2.01, 2.03], 40: [2.00 + GENTLE + 0.01, 2.02 + GENTLE + 0.01]}
    assert claim_c(_sync_every(steep, adamw=9.0))[1] == NOT_REPRODUCED
    unordered = {5: [2.00, 2.02], 10: [1.99, 2.00], 40: [2.01, 2.03]}
    assert claim_c(_sync_every(unordered))[1] == NOT_REPRODUCED


def test_the_verdict_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Changing a threshold in the table changes both the verdict and the printed rule: the code
    holds no copy of it."""
    gentle = _sync_every({5: [2.00, 2.00], 40: [2.04, 2.04]})
    assert claim_c(gentle)[1] == REPRODUCED
    order, spread = RULES["c"]
    tight = {**RULES, "c": (order, dataclasses.replace(spread, threshold=0.03))}
    monkeypatch.setattr(rules, "RULES", tight)
    assert claim_c(gentle)[1] == NOT_REPRODUCED
    assert "at most +0.03 nats" in rule_text("c")
    assert claims.decide is rules.decide


@pytest.mark.parametrize(
    ("test", "values", "threshold", "holds"),
    [
        ("beats", [[-0.1, -0.2]], 0, True),
        ("beats", [[-0.1, 0.0]], 0, False),
        ("worse", [[0.1], [0.2]], 0, True),
        ("worse", [[0.1], [-0.2]], 0, False),
        ("within", [[0.01, 0.03]], 0.02, True),
        ("within", [[0.02, 0.03]], 0.02, False),
        ("close", [[-0.02, -0.01]], 0.02, True),
        ("close", [[-0.03, -0.02]], 0.02, False),
        ("rises", [[1.0, 1.0, 2.0]], 0, True),
        ("rises", [[1.0, 0.9]], 0, False),
        ("falls", [[3.0, 2.0, 1.0]], 0, True),
        ("falls", [[3.0, 3.0]], 0, False),
        ("shrinks", [[0.3, 0.2, 0.1]], 0, True),
        ("shrinks", [[0.1, 0.2]], 0, False),
        ("ratio", [[50.0], [51.0]], 50, True),
        ("ratio", [[49.9]], 50, False),
        ("below", [[0.9, 0.99]], 1, True),
        ("below", [[0.9, 1.0]], 1, False),
        ("larger", [[0.01]], 0, True),
        ("beats", [], 0, False),  # no rows: nothing shown, so not reproduced
        ("within", [[]], 0.02, False),
    ],
)
def test_tests_by_hand(test: str, values: list[list[float]], threshold: float, holds: bool) -> None:
    assert Check("rows", test, "ref", threshold).holds(values) is holds


def test_bad_tables_and_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown test"):
        Check("rows", "better")
    with pytest.raises(ValueError, match="claim c has 2 checks"):
        decide("c", [[1.0, 2.0]])
