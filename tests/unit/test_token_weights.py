"""Token weighting's pure parts: how a server reads an upload's ``tokens`` under each
``--weighting``, and how the Lightning and Hugging Face callbacks count tokens from a batch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.wire.messages import MessageError, UploadMeta
from diloco.wire.messages.uploads import MAX_WEIGHT, MIN_WEIGHT

HEAD = {"worker_id": "w", "submission_id": "s", "base_round": "0"}


def test_tokens_round_trip_and_become_the_weight_under_tokens_weighting() -> None:
    meta = UploadMeta("w", "s", 2, 3.0, tokens=4096.0)
    pairs = meta.to_metadata()
    assert pairs["tokens"] == "4096.0" and pairs["weight"] == "3.0"
    read = UploadMeta.from_metadata(pairs, weighting="tokens")
    assert (read.weight, read.tokens) == (4096.0, 4096.0)  # the samples' weight is not used
    assert UploadMeta.from_metadata(pairs, weighting="samples").weight == 3.0
    assert UploadMeta.from_metadata(pairs, weighting="equal").weight == 1.0
    assert "tokens" not in UploadMeta("w", "s", 0).to_metadata()  # none counted: key absent


def test_tokens_weighting_needs_the_key() -> None:
    with pytest.raises(MessageError) as info:
        UploadMeta.from_metadata({**HEAD, "weight": "5"}, weighting="tokens")
    assert (info.value.code, info.value.field) == ("missing_metadata", "tokens")
    assert "report(tokens=n)" in info.value.detail


@pytest.mark.parametrize(
    "raw", ["abc", "nan", "inf", "-1", "0", str(MIN_WEIGHT / 10), str(MAX_WEIGHT * 10)]
)
def test_a_malformed_token_count_is_refused_with_the_weights_bounds(raw: str) -> None:
    with pytest.raises(MessageError) as info:
        UploadMeta.from_metadata({**HEAD, "tokens": raw}, weighting="tokens")
    assert (info.value.code, info.value.field) == ("bad_metadata", "tokens")
    assert raw in info.value.detail


def test_tokens_are_not_read_unless_the_server_weights_by_them() -> None:
    for weighting in ("equal", "samples"):
        assert (
            UploadMeta.from_metadata({**HEAD, "tokens": "abc"}, weighting=weighting).tokens is None
        )


def test_lightning_counts_a_batchs_kept_tokens() -> None:
    pytest.importorskip("lightning")
    from diloco.integrations.lightning import _batch_tokens

    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert _batch_tokens({"input_ids": ids, "attention_mask": mask}) == 8  # padding left out
    assert _batch_tokens({"input_ids": ids}) == 10
    assert _batch_tokens((ids, ids)) is None  # not a language-model mapping: no tokens
    assert _batch_tokens(ids) is None
    assert _batch_tokens({"x": ids}) is None


def test_hugging_face_reports_the_tokens_the_trainer_counted_since_the_last_step() -> None:
    pytest.importorskip("transformers")
    from diloco.integrations.transformers import DiLoCoCallback

    cb = DiLoCoCallback("127.0.0.1:1", sync_every=2)
    told: list[dict[str, Any]] = []
    cb._core.report = lambda **kw: told.append(kw)  # type: ignore[method-assign]
    cb._samples_per_step = 4
    args = SimpleNamespace(include_num_input_tokens_seen=True)
    for seen in (300, 700, 1200):
        state = SimpleNamespace(num_input_tokens_seen=seen)
        cb.on_pre_optimizer_step(args, state, None)  # type: ignore[arg-type]
    assert told == [
        {"samples": 4, "tokens": 300},
        {"samples": 4, "tokens": 400},
        {"samples": 4, "tokens": 500},
    ]
    told.clear()
    off = SimpleNamespace(include_num_input_tokens_seen=False)
    cb.on_pre_optimizer_step(off, SimpleNamespace(num_input_tokens_seen=0), None)  # type: ignore[arg-type]
    assert told == [{"samples": 4, "tokens": None}]  # the Trainer counts none: none reported
