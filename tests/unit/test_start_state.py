"""``StartState``: a checkpoint's round, snapshot and momentum as a worker starts from them
(``worker/state/start_state.py``); what it refuses, before anything is copied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.persistence.folders import Checkpoint
from diloco.worker.state.start_state import StartState

PARAMS = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}


def checkpoint(momentum: dict[int, torch.Tensor] | None = None, **extra: Any) -> Checkpoint:
    state = {i: {"momentum_buffer": t} for i, t in (momentum or {}).items()}
    extra = {"param_order": ["a", "b"], "mode": "sync", "fragments": [1, "sequential"], **extra}
    return Checkpoint(Path("ck"), 7, dict(PARAMS), {"state": state, "param_groups": []}, extra)


def test_the_round_params_and_momentum_in_param_order_load_in_place() -> None:
    mom = {0: torch.full((2, 3), 0.5), 1: torch.full((4,), -1.0)}
    start = StartState.of_checkpoint(checkpoint(mom))
    assert start.round == 7 and list(start.params) == ["a", "b"]
    snapshot = {n: torch.zeros_like(t) for n, t in PARAMS.items()}
    buffers = [torch.zeros(2, 3), torch.zeros(4)]
    held = list(buffers)  # the outer optimizer's references: the copy is in place
    start.load(snapshot, buffers)
    assert all(torch.equal(snapshot[n], PARAMS[n]) for n in PARAMS)
    assert torch.equal(held[0], mom[0]) and torch.equal(held[1], mom[1])


def test_without_momentum_a_run_with_momentum_keeps_zeros_and_one_without_takes_none() -> None:
    start = StartState.of_checkpoint(checkpoint())
    assert start.momentum is None
    buffers = [torch.ones(2, 3), torch.ones(4)]
    start.load({n: torch.zeros_like(t) for n, t in PARAMS.items()}, buffers)
    assert all(b.count_nonzero() == 0 for b in buffers)
    start.load({n: torch.zeros_like(t) for n, t in PARAMS.items()}, [])


@pytest.mark.parametrize(
    ("ck", "says"),
    [
        (checkpoint(fragments=[2, "sequential"]), "whole-model"),
        (checkpoint(mode="async"), "whole-model"),
        (checkpoint(outer_optimizer="DelayedNesterov"), "DelayedNesterov"),
        (checkpoint(param_order=["a"]), "param_order"),
        (checkpoint({0: torch.zeros(2, 3)}), "misses"),
        (checkpoint({0: torch.zeros(2, 3), 1: torch.zeros(5)}), "momentum of 'b'"),
    ],
)
def test_a_checkpoint_not_of_the_whole_models_layout_is_refused(ck: Checkpoint, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        StartState.of_checkpoint(ck)


def test_a_state_not_the_models_is_refused_before_anything_is_copied() -> None:
    start = StartState.of_checkpoint(checkpoint({0: torch.ones(2, 3), 1: torch.ones(4)}))
    for snapshot, buffers, says in [
        ({"a": torch.zeros(2, 3), "c": torch.zeros(4)}, [], "not the model's"),
        ({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, [], "'a' is"),
        ({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, [torch.zeros(2, 3)], "the run has 1"),
    ]:
        with pytest.raises(ValueError, match=says):
            start.load(snapshot, buffers)
        assert all(t.count_nonzero() == 0 for t in [*snapshot.values(), *buffers])
