"""N workers through a real server end with the same parameters as single-process DiLoCo."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.reference import (
    assert_same_params,
    make_model,
    reference_rounds,
    through_server,
)

SYNC_EVERY = 4
ROUNDS = 3


def reference_diloco(num_workers: int) -> dict[str, torch.Tensor]:
    """DiLoCo in one process: the outer gradient is the workers' plain mean."""

    def mean(pseudo_grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.stack(ts).sum(0) / num_workers for ts in zip(*pseudo_grads, strict=True)]

    return reference_rounds(num_workers, SYNC_EVERY, ROUNDS, mean)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_workers_through_server_match_single_process_diloco(num_workers: int) -> None:
    expected = reference_diloco(num_workers)
    got, metrics, server_round = through_server(
        num_workers, SYNC_EVERY * ROUNDS, sync_every=SYNC_EVERY
    )
    assert all(m["rounds"] == ROUNDS for m in metrics)
    assert server_round == ROUNDS
    assert set(got) == set(expected)
    assert_same_params(got, expected)


def test_reference_actually_moves_parameters() -> None:
    # Guards the test above against a vacuous pass (e.g. zero learning rates).
    start = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    end = reference_diloco(2)
    assert any(not torch.equal(start[n], end[n]) for n in start)
