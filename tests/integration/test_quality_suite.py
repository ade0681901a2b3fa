"""The quality suite (benchmarks/quality/, issue 20) without its runs: the one-GPU profile
builds and steps on CPU, and claims n and o judge by the rules the page prints, on made-up
results. The fast run of every experiment through the real server and workers is
tests/processes/test_quality_suite.py. No measured loss is asserted: at this size a figure could
fail by chance."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from benchmarks.quality.protocol import GPU, pretrained, run_single


@pytest.mark.timeout(120)
def test_gpu_profile_builds_and_steps_on_cpu(tmp_path: Path) -> None:
    """The one-GPU profile (not run here): its ~20M-parameter model and its standard-library
    corpus build, and one tiny step runs on CPU, pretrain and baseline paths included."""
    profile = replace(GPU, device="cpu", seq_len=32, batch_size=2, max_bytes=400_000)
    params = sum(p.numel() for p in profile.model(0).parameters())
    assert 15e6 < params < 25e6, params
    corpus = profile.corpus(2, "non-iid")
    assert len(corpus.shards) == 2 and min(len(s) for s in corpus.shards) > profile.seq_len
    assert int(corpus.eval.max()) < 256
    threads = torch.get_num_threads()  # the suite pins one thread; give the others theirs back
    try:
        init = pretrained(profile, 0, 1, tmp_path)
        row = run_single("one step", profile, 0, init, corpus, steps=1, warmup=1, windows=2)
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(row["eval_loss"]) and len(row["curve"]) == 2


def _sparse_row(name: str, seed: int, loss: float, up: int, down: int) -> dict:
    """A ``sparse`` row of two workers and 10 rounds: ``up``/``down`` bytes per worker per round,
    each worker's join a 1000-byte download."""
    workers = [{"rounds": 10, "join_bytes_down": 1000, "bytes_down": 1000 + 10 * down}] * 2
    return {
        "name": name,
        "seed": seed,
        "eval_loss": loss,
        "updates": 10,
        "bytes_up": 2 * 10 * up,
        "config": {"workers": 2},
        "workers": workers,
    }


def _sparse_results(loss: float, up: int, down: int) -> dict:
    """fp32 at 5000 bytes each way per round, the three top-k rows at ``loss`` above it, ``up``
    bytes up and (sparse downlink only) ``down`` bytes down."""
    rows = []
    for seed in (0, 1):
        rows += [
            _sparse_row("fp32", seed, 2.0, 5000, 5000),
            _sparse_row("topk + EF, Nesterov", seed, 2.0 + loss, up, 5000),
            _sparse_row("topk + EF, SparseLoCo rule", seed, 2.0 + loss, up, 5000),
            _sparse_row("topk + EF, SparseLoCo rule, sparse downlink", seed, 2.0 + loss, up, down),
        ]
    return {"sparse": {"experiment": "sparse", "rows": rows}}


def test_claim_n_rule_is_the_printed_one() -> None:
    """Claim n holds only when every top-k row is within MATCH of fp32 at UP_RATIO times fewer
    upload bytes per round and the sparse downlink at DOWN_RATIO times fewer download bytes
    (the join's download left out); the claim and the rules on the page name those figures."""
    from benchmarks.quality.claims import CLAIMS, NOT_REPRODUCED, REPRODUCED, claim_n
    from benchmarks.quality.rules import DOWN_RATIO, MATCH, UP_RATIO, rule_text

    up_ok, down_ok = 5000 // UP_RATIO, 5000 // DOWN_RATIO
    ours, verdict, _ = claim_n(_sparse_results(MATCH / 2, up_ok, down_ok))
    assert verdict == REPRODUCED, ours
    assert f"÷{UP_RATIO:.1f} up" in ours and f"÷{DOWN_RATIO:.1f} down" in ours, ours
    assert claim_n(_sparse_results(MATCH * 1.5, up_ok, down_ok))[1] == NOT_REPRODUCED
    assert claim_n(_sparse_results(MATCH / 2, up_ok + 10, down_ok))[1] == NOT_REPRODUCED
    assert claim_n(_sparse_results(MATCH / 2, up_ok, down_ok + 10))[1] == NOT_REPRODUCED
    text = next(c[2] for c in CLAIMS if c[0] == "n")
    assert f"{UP_RATIO}x fewer upload" in text and f"{DOWN_RATIO}x fewer download" in text
    rule = rule_text("n")
    assert f"at most +{MATCH} nats" in rule and f"at least {UP_RATIO} times" in rule
    assert f"at least {DOWN_RATIO} times" in rule


def test_claim_o_holds_within_match_of_fp32_all_reduce() -> None:
    """Claim o: int8 all-reduce's mean paired difference from fp32 all-reduce at most MATCH;
    its bytes are the collectives' (``collective`` rows: sent and received over rounds and
    members)."""
    from benchmarks.quality.claims import NOT_REPRODUCED, REPRODUCED, claim_o
    from benchmarks.quality.rules import MATCH
    from benchmarks.quality.stats import down_per_round, up_per_round

    def row(name: str, seed: int, loss: float, sent: int) -> dict:
        return {
            "name": name,
            "seed": seed,
            "eval_loss": loss,
            "updates": 10,
            "collective": True,
            "bytes_up": 2 * 10 * sent,
            "bytes_down": 2 * 10 * sent,
            "config": {"workers": 2},
        }

    def results(diff: float) -> dict:
        rows = []
        for seed in (0, 1, 2):
            rows += [row("fp32 all-reduce", seed, 2.0, 4000), row("int8", seed, 2.0 + diff, 1000)]
        return {"allreduce_codecs": {"rows": rows}}

    ours, verdict, _ = claim_o(results(MATCH * 0.9))
    assert verdict == REPRODUCED and "÷4.0 bytes sent" in ours, ours
    assert claim_o(results(MATCH * 1.1))[1] == NOT_REPRODUCED
    one = row("int8", 0, 2.0, 1000)
    assert up_per_round(one) == down_per_round(one) == 1000
