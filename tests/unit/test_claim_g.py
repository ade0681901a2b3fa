"""Claim g of the quality page (issue 32) judged on made-up curves: the simulated time each
async configuration takes to reach sync's final loss, by the rule the page prints."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.quality.claims import CLAIMS, NOT_REPRODUCED, REPRODUCED, claim_g
from benchmarks.quality.reach import TIMED, ratios, reach_times, time_to_loss
from benchmarks.quality.rules import RULES, Check, rule_text


def curve(*points: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"wall_s": t, "eval_loss": loss} for t, loss in points]


SYNC = curve((0, 3.0), (10, 2.5), (20, 2.2), (30, 2.0))  # final loss 2.0 at t = 30


def results(dylu: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for seed, c in dylu.items():
        rows += [
            {"name": "sync", "seed": seed, "curve": SYNC, "wall_s": 30.0, "eval_loss": 2.0},
            {"name": "async + DN", "seed": seed, "curve": c, "wall_s": 20.0, "eval_loss": 2.0},
            {"name": "async + DN + DyLU", "seed": seed, "curve": c, "wall_s": 20.0},
            {"name": TIMED, "seed": seed, "curve": c, "wall_s": 30.0},
        ]
    return {"async": {"experiment": "async", "rows": rows}}


def test_time_to_loss_is_the_first_point_at_or_below_the_target() -> None:
    assert time_to_loss(SYNC, 2.2) == 20
    assert time_to_loss(SYNC, 2.0) == 30
    assert time_to_loss(SYNC, 1.9) is None


def test_faster_in_every_seed_reproduces() -> None:
    """Async reaches 2.0 at 15 and 25 (sync at 30): ratios 0.50 and 0.83, reproduced."""
    res = results({0: curve((0, 3.0), (15, 1.99)), 1: curve((0, 3.0), (25, 2.0))})
    assert reach_times(res["async"], TIMED) == {0: (30, 15), 1: (30, 25)}
    ours, verdict, _ = claim_g(res)
    assert verdict == REPRODUCED
    assert "DN + DyLU: 0.50, 0.83" in ours and "seed: DN: 0.50, 0.83;" in ours


def test_one_seed_slower_or_never_is_not_reproduced() -> None:
    """One seed reaches sync's loss later than sync (35 > 30), or never: not reproduced, even
    when the run itself ends sooner (its wall time 20 < 30), which the old rule rewarded."""
    late = results({0: curve((0, 3.0), (15, 1.9)), 1: curve((0, 3.0), (35, 2.0))})
    assert claim_g(late)[1] == NOT_REPRODUCED
    never = results({0: curve((0, 3.0), (15, 1.9)), 1: curve((0, 3.0), (20, 2.01))})
    ours, verdict, _ = claim_g(never)
    assert verdict == NOT_REPRODUCED and "never" in ours


def test_the_sooner_check_by_hand() -> None:
    """Times to sync's final loss 15, 25 and never against sync's 30: ratios 0.5, 25/30 and
    infinity. The "sooner" check at threshold 1 holds only when every seed's ratio is below 1:
    a tie (1.0) or a seed that never got there fails it, and so does no seed at all."""
    times: dict[int, tuple[float, float | None]] = {0: (30, 15), 1: (30, 25), 2: (30, None)}
    assert ratios(times) == [0.5, 25 / 30, math.inf]
    check = Check("row", "sooner", "sync", 1.0)
    assert check.holds([[0.5, 25 / 30]])
    assert not check.holds([[0.5, 1.0]]) and not check.holds([[0.5, math.inf]])
    assert not check.holds([[]]) and not check.holds([])


def test_the_rule_applied_is_the_one_the_page_prints() -> None:
    """g's rule is one check of the rule table: the sentence the page prints (``rule_text``)
    names the row it judges and the time-to-reach test, and g's row names what it measures."""
    assert [c.test for c in RULES["g"]] == ["sooner"]
    text = rule_text("g")
    assert TIMED in text and "sync's final loss" in text and "simulated time" in text
    g = next(c for c in CLAIMS if c[0] == "g")
    assert "wall-clock time" in g[2] and g[4] is claim_g
