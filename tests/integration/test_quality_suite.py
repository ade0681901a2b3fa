"""The quality suite (benchmarks/quality/, issue 20) in its fast setting: every experiment runs
through the real server and workers, its results file has the expected shape, and the docs page
renders with one claims row per claim a-m. No loss value is asserted: at this size a figure could
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
        row = run_single(
            "one step", profile, 0, init, corpus, steps=1, warmup=1, curve_windows=2, eval_windows=2
        )
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(row["eval_loss"]) and len(row["curve"]) == 2
