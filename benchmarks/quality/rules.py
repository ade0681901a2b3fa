"""The verdict rules of docs/quality.md as data (issue 32): for each claim the checks its verdict
needs, each naming the rows it compares, the test, the reference and the threshold. Both the code
that decides a verdict (``decide``) and the sentence the page prints (``rule_text``) are derived
from ``RULES``, so the page cannot state one rule while the code applies another (the audit found
claim c judged by a rule the page never stated). Not run on its own (``claims.py`` uses it).

A check is applied to lists of numbers, one list per row it covers (a claim function in
``claims.py`` computes them, in the order of the checks); it holds when its test holds for every
list. Paired tests take per-seed differences ``row - reference`` (same seed, same pretrained
start); the others take what their sentence says (a sequence of means, per-seed ratios).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.quality.reach import TIMED

MATCH = 0.02  # nats per byte (about 2% perplexity): "matches", "lossless", "costs almost nothing"
GENTLE = 0.05  # nats per byte (about 5% perplexity): "degrades gently", "hurts little"
# Claim n (issue 30): "at 50x fewer upload bytes", "at 20x fewer download bytes".
UP_RATIO, DOWN_RATIO = 50, 20

Values = list[float]


def _all(pred: Callable[[float], bool]) -> Callable[[Values, float], bool]:
    return lambda xs, t: bool(xs) and all(pred(x) for x in xs)


def _pairs(pred: Callable[[float, float], bool]) -> Callable[[Values, float], bool]:
    return lambda xs, t: len(xs) >= 2 and all(pred(a, b) for a, b in zip(xs, xs[1:], strict=False))


# test -> (its sentence, with {reference} and {threshold}; whether it takes paired differences;
# the test on one list of numbers and the threshold)
TESTS: dict[str, tuple[str, bool, Callable[[Values, float], bool]]] = {
    "beats": ("a lower loss than {reference} in every seed", True, _all(lambda x: x < 0)),
    "worse": ("a higher loss than {reference} in every seed", True, _all(lambda x: x > 0)),
    "within": (
        "a mean difference from {reference} of at most +{threshold} nats per byte",
        True,
        lambda xs, t: bool(xs) and statistics.mean(xs) <= t,
    ),
    "close": (
        "a mean difference from {reference} of at most ±{threshold} nats per byte",
        True,
        lambda xs, t: bool(xs) and abs(statistics.mean(xs)) <= t,
    ),
    "rises": (
        "a mean loss that never falls from one to the next",
        False,
        _pairs(lambda a, b: b >= a),
    ),
    "falls": ("a mean loss lower than the one before", False, _pairs(lambda a, b: b < a)),
    "shrinks": (
        "the last smaller than the first",
        False,
        lambda xs, t: len(xs) >= 2 and xs[-1] < xs[0],
    ),
    "larger": ("larger than {reference}", False, _all(lambda x: x > 0)),
    "less": ("smaller than {reference} in every seed", True, _all(lambda x: x < 0)),
    "ratio": (
        "{reference} at least {threshold:g} times the row's",
        False,
        lambda xs, t: bool(xs) and min(xs) >= t,
    ),
    "below": ("below {threshold:g} in every seed", False, lambda xs, t: bool(xs) and max(xs) < t),
    # Claim g (issue 32): per seed, the row's simulated time to the reference's final loss over
    # the reference's own (``reach.ratios``; infinity where the row never gets there).
    "sooner": (
        "reaches {reference}'s final loss (the last point of its curve) sooner than {reference}"
        " on the simulated clock, its time over {reference}'s below {threshold:g} in every seed"
        " (never reaching it fails)",
        False,
        lambda xs, t: bool(xs) and max(xs) < t,
    ),
}


@dataclass(frozen=True)
class Check:
    """One condition of a claim's rule: ``rows`` have the property ``test`` (against
    ``reference`` with ``threshold`` where the test takes them)."""

    rows: str  # the rows (or the quantity) tested, as the page names them
    test: str  # a key of TESTS
    reference: str = ""
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.test not in TESTS:
            raise ValueError(f"unknown test {self.test!r}; known: {', '.join(TESTS)}")

    @property
    def paired(self) -> bool:
        return TESTS[self.test][1]

    def sentence(self) -> str:
        words = TESTS[self.test][0].format(reference=self.reference, threshold=self.threshold)
        return f"{self.rows}: {words}" + (" (paired by seed)" if self.paired else "")

    def holds(self, values: list[Values]) -> bool:
        """True when the test holds for every row's list (and there is at least one)."""
        test = TESTS[self.test][2]
        return bool(values) and all(test(v, self.threshold) for v in values)


ONE_WORKER = "one-worker AdamW at equal steps"
RULES: dict[str, tuple[Check, ...]] = {
    "a": (Check("DiLoCo M=4 and M=8, each", "beats", ONE_WORKER),),
    "b": (
        Check("DiLoCo M = 1, 2, 4, 8 in order", "falls"),
        Check("the mean loss's gains per doubling of M", "shrinks"),
    ),
    "c": (
        Check("the H values, smallest to largest", "rises"),
        Check("the largest H", "within", "the smallest H", GENTLE),
    ),
    "d": (Check("averaging and SGD momentum, each", "worse", "outer Nesterov"),),
    "e": (Check("DiLoCo M=1", "beats", ONE_WORKER),),
    "f": (
        Check("naive async", "worse", "sync"),
        Check("async + DN + DyLU", "within", "sync", MATCH),
    ),
    "g": (Check(f"{TIMED} (trained for sync's simulated time)", "sooner", "sync", 1.0),),
    "h": (
        Check("every streaming row", "within", "DiLoCo", MATCH),
        Check("every streaming row's peak bytes per sync, times P", "ratio", "DiLoCo's", 0.9),
    ),
    "i": (
        Check("tau = 1, alpha = 0.5", "within", "tau = 0", MATCH),
        Check("the largest tau, alpha = 0.5", "within", "tau = 0", GENTLE),
    ),
    "j": (Check("int8 and int4 with error feedback, each", "within", "fp32", MATCH),),
    "k": (Check("50% of uploads lost", "within", "none lost", GENTLE),),
    "l": (
        Check("skewed non-iid at the end", "close", "iid", MATCH),
        Check("skewed non-iid at 25% of the steps", "worse", "iid"),
        Check("the mean non-iid − iid gap at 25% of the steps", "larger", "the gap at the end"),
    ),
    "m": (Check("DiLoCo M=4", "worse", "data-parallel at M times the batch"),),
    "n": (
        Check("every topk row", "within", "fp32", MATCH),
        Check("every topk row's upload bytes per round", "ratio", "fp32's", UP_RATIO),
        Check("the sparse downlink's download bytes per round", "ratio", "fp32's", DOWN_RATIO),
    ),
    "o": (Check("int8 all-reduce", "within", "fp32 all-reduce", MATCH),),
    "p": (
        Check(
            "Muon's loss at the largest M minus its loss at M=1",
            "less",
            "AdamW's same difference",
        ),
    ),
    "q": (Check("quorum 3 of 4, auto grace", "within", "the barrier", MATCH),),
}


def rule_text(claim: str) -> str:
    """The rule of ``claim`` as the page prints it: its checks' sentences, all required."""
    return "; and ".join(c.sentence() for c in RULES[claim]) + "."


def decide(claim: str, *values: list[Values]) -> bool:
    """Whether ``claim`` is reproduced: ``values`` holds, for each of its checks in order, one
    list of numbers per row the check covers."""
    checks = RULES[claim]
    if len(values) != len(checks):
        raise ValueError(f"claim {claim} has {len(checks)} checks, got {len(values)} value sets")
    return all(check.holds(v) for check, v in zip(checks, values, strict=True))


DEFINITIONS = f"""Verdict rules, fixed before the runs, one per claim in the table below (the
code that decides each verdict reads the same table, `benchmarks/quality/rules.py`). Losses are
final eval losses on the test split, in nats per byte; "paired by seed": per-seed differences
row − reference, same seed and pretrained start. The thresholds: {MATCH} nats per byte (about 2%
perplexity) for "matches", "lossless", "costs almost nothing" and "end close"; {GENTLE} (about
5%) for "degrades gently" and "hurts little"."""
