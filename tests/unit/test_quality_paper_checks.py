"""Claims i and k run the papers' procedures (benchmarks/quality/experiments.py): i both series
of Streaming DiLoCo's figure 8 (tau swept at alpha 0.5 and at alpha 0, against no overlap), shown
beside the verdict; k each worker's upload of each round lost with probability 0.5."""

from __future__ import annotations

from benchmarks.quality.claims import REPRODUCED, claim_i
from benchmarks.quality.experiments import DEFAULT, dropped, overlap


def test_overlap_runs_both_alpha_series_against_no_overlap() -> None:
    configs = overlap(DEFAULT)
    ref, *rest = configs
    assert ref.worker == {"num_fragments": 4, "fragment_pattern": "strided", "merge_alpha": 0.0}
    series = [(c.worker["merge_alpha"], c.worker["overlap_steps"]) for c in rest]
    assert series == [(0.5, 1), (0.5, 2), (0.5, 4), (0.0, 1), (0.0, 2), (0.0, 4), (0.5, 0)]
    assert rest[-1].name.endswith("(control)")


def test_claim_i_judges_alpha_half_and_shows_alpha_zero_beside_it() -> None:
    """The verdict reads the alpha 0.5 series (the claim's); the alpha 0 series and the control
    are in the note."""
    ref, *rest = overlap(DEFAULT)
    rows = [{"name": ref.name, "seed": 0, "eval_loss": 2.0}]
    for c in rest:
        alpha0 = "alpha=0.0" in c.name
        rows.append({"name": c.name, "seed": 0, "eval_loss": 2.0 + (0.5 if alpha0 else 0.001)})
    ours, verdict, note = claim_i({"overlap": {"rows": rows}})
    assert verdict == REPRODUCED, ours
    assert "tau=1, alpha=0.0: +0.500" in note and "tau=0, alpha=0.5: +0.001" in note


def test_dropped_loses_each_workers_upload_of_each_round_with_probability_half() -> None:
    kept, lost = dropped(DEFAULT)
    assert (kept.drop_prob, lost.drop_prob) == (0.0, 0.5)
    assert lost.workers == DEFAULT.workers and lost.sync_every == DEFAULT.sync_every
