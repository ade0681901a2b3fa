"""What the all-reduce mode's int8/int4 collectives refuse on the worker: a sharded worker
group's whole-model rounds (averaged shard by shard, fp32 or bf16 only) are refused when the
strategy is chosen, before anything joins a quorum; its streaming fragments are not."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.worker.choose import SHARDED_QUANTIZED, _quorum_sync
from diloco.worker.settings import WorkerSettings


@pytest.mark.parametrize("codec", ["int8", "int4", "topk"])
def test_a_sharded_group_whole_model_round_refuses_a_quantized_codec(codec: str) -> None:
    settings = WorkerSettings(codec=codec, sync_every=4)
    parts: Any = object()  # a sharded group's per-shard state: the refusal comes first
    with pytest.raises(ValueError) as err:
        _quorum_sync(settings, None, None, None, parts)  # type: ignore[arg-type]
    assert str(err.value) == SHARDED_QUANTIZED
    assert "fp32 or bf16" in SHARDED_QUANTIZED and "num_fragments > 1" in SHARDED_QUANTIZED


def test_bf16_passes_the_check_to_the_sharded_state() -> None:
    """Past the check, the stub ``parts`` breaks the state's construction: another error."""
    settings = WorkerSettings(codec="bf16", sync_every=4)
    parts: Any = object()
    with pytest.raises(Exception) as err:
        _quorum_sync(settings, None, None, None, parts)  # type: ignore[arg-type]
    assert str(err.value) != SHARDED_QUANTIZED
