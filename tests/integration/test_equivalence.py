"""N workers through a real server end with the same parameters as single-process DiLoCo."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.reference import (
    assert_same_params,
    batches,
    make_inner,
    make_model,
    through_server,
    train_step,
)

SYNC_EVERY = 4
ROUNDS = 3


def reference_diloco(num_workers: int) -> dict[str, torch.Tensor]:
    """DiLoCo in one process, written as plainly as the paper's Algorithm 1."""
    global_model = make_model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [make_model() for _ in range(num_workers)]
    inners = [make_inner(m) for m in workers]  # inner optimizer state persists across rounds
    data = [batches(i, SYNC_EVERY * ROUNDS) for i in range(num_workers)]
    for r in range(ROUNDS):
        pseudo_grads = []
        for i, (model, inner) in enumerate(zip(workers, inners, strict=True)):
            model.load_state_dict(global_model.state_dict())
            for step in range(SYNC_EVERY):
                train_step(model, inner, data[i][r * SYNC_EVERY + step])
            pseudo_grads.append(
                [
                    g.detach() - p.detach()
                    for g, p in zip(global_model.parameters(), model.parameters(), strict=True)
                ]
            )
        with torch.no_grad():
            for j, p in enumerate(global_model.parameters()):
                p.grad = torch.stack([pg[j] for pg in pseudo_grads]).sum(0) / num_workers
        outer.step()
        outer.zero_grad()
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


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
