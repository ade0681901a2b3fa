"""N workers through a real server end with the same parameters as single-process DiLoCo."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.reference import batches, make_inner, make_model, train_step

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


def run_through_server(num_workers: int) -> dict[str, torch.Tensor]:
    with DiLoCoServer(ServerConfig(port=0, num_workers=num_workers)) as server:
        errors: list[BaseException] = []

        # Built here, not in the threads: torch.manual_seed is process-global and would interleave.
        models = [make_model() for _ in range(num_workers)]

        def work(i: int) -> None:
            try:
                model = models[i]
                inner = make_inner(model)
                with DiLoCoWorker(
                    model,
                    inner,
                    server.address,
                    sync_every=SYNC_EVERY,
                    bf16_comm=False,
                    worker_id=f"w{i}",
                    heartbeat_interval=0,
                ) as worker:
                    for batch in batches(i, SYNC_EVERY * ROUNDS):
                        train_step(model, inner, batch)
                assert worker.sync_metrics["rounds"] == ROUNDS
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert server.status()["round"] == ROUNDS
        return server.global_params()


@pytest.mark.parametrize("num_workers", [1, 3])
def test_workers_through_server_match_single_process_diloco(num_workers: int) -> None:
    expected = reference_diloco(num_workers)
    got = run_through_server(num_workers)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


def test_reference_actually_moves_parameters() -> None:
    # Guards the test above against a vacuous pass (e.g. zero learning rates).
    start = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    end = reference_diloco(2)
    assert any(not torch.equal(start[n], end[n]) for n in start)
