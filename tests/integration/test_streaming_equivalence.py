"""Streaming DiLoCo workers through a real server end where single-process streaming DiLoCo does.

Sync mode: fragment f of every worker is sent after the same inner step, its round closes when
both have sent it, and each merges the result ``tau`` steps later (before its next step when
tau = 0), so thread timing cannot change any value. The reference below is the paper's algorithm written plainly: one outer
SGD-Nesterov per fragment over that fragment's elements.
"""

from __future__ import annotations

import pytest
import torch

from diloco.core.fragments import fragment_due, split_sequential, split_strided
from tests.helpers.reference import (
    assert_same_params,
    batches,
    make_inner,
    make_model,
    through_server,
    train_step,
)

SYNC_EVERY = 6
PERIODS = 2
STEPS = SYNC_EVERY * PERIODS


def reference_streaming(
    num_workers: int, num_fragments: int, pattern: str, alpha: float, tau: int = 0
) -> dict[str, torch.Tensor]:
    template = make_model()
    names = [n for n, _ in template.named_parameters()]
    global_flat = {n: p.detach().reshape(-1).clone() for n, p in template.named_parameters()}
    split = split_sequential if pattern == "sequential" else split_strided
    plan = split([(n, t.numel()) for n, t in global_flat.items()], num_fragments)
    # One outer optimizer per fragment, over copies of its pieces.
    outer_params = [
        [torch.nn.Parameter(global_flat[s.name][s.start : s.stop].clone()) for s in frag]
        for frag in plan
    ]
    outers = [torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True) for ps in outer_params]
    workers = [make_model() for _ in range(num_workers)]
    inners = [make_inner(m) for m in workers]
    snapshots = [{n: t.clone() for n, t in global_flat.items()} for _ in range(num_workers)]
    data = [batches(i, STEPS) for i in range(num_workers)]
    last_sync = [0] * num_fragments

    def outer_step(f: int) -> list[torch.Tensor]:
        """Every worker's pseudo-gradient of fragment f, averaged, one outer step."""
        locals_ = [dict(m.named_parameters()) for m in workers]
        with torch.no_grad():
            for j, s in enumerate(plan[f]):
                grads = [
                    snapshots[i][s.name][s.start : s.stop]
                    - locals_[i][s.name].reshape(-1)[s.start : s.stop]
                    for i in range(num_workers)
                ]
                outer_params[f][j].grad = torch.stack(grads).sum(0) / num_workers
            outers[f].step()
            outers[f].zero_grad()
            news = [p.detach().clone() for p in outer_params[f]]
            for j, s in enumerate(plan[f]):
                global_flat[s.name][s.start : s.stop] = news[j]
        return news

    def merge(f: int, news: list[torch.Tensor]) -> None:
        """Every worker: local = alpha * local + (1 - alpha) * global; snapshot = global."""
        with torch.no_grad():
            for i, model in enumerate(workers):
                params = dict(model.named_parameters())
                for j, s in enumerate(plan[f]):
                    local = params[s.name].view(-1)[s.start : s.stop]
                    local.mul_(alpha).add_(news[j], alpha=1 - alpha)
                    snapshots[i][s.name][s.start : s.stop] = news[j]

    pending: tuple[int, int, list[torch.Tensor]] | None = None  # (merge after step, fragment, new)
    for t in range(1, STEPS + 1):
        for i in range(num_workers):
            train_step(workers[i], inners[i], data[i][t - 1])
        if pending is not None and t >= pending[0]:
            merge(pending[1], pending[2])
            pending = None
        f = fragment_due(t, SYNC_EVERY, num_fragments)
        if f is not None:
            assert pending is None, "the tests keep tau below the steps between fragments"
            pending = (t + tau, f, outer_step(f))
            last_sync[f] = t
            if tau == 0:
                merge(f, pending[2])
                pending = None
    if pending is not None:  # on exit the exchange in flight is merged first
        merge(pending[1], pending[2])
    # On exit every worker hands in each fragment's steps since it last synced: one more round
    # of those fragments (all but the last, which synced after the final step).
    for f in range(num_fragments):
        if last_sync[f] < STEPS:
            outer_step(f)
    shapes = dict(template.named_parameters())
    return {n: global_flat[n].view(shapes[n].shape) for n in names}


def run_through_server(
    num_workers: int,
    num_fragments: int,
    pattern: str,
    alpha: float,
    tau: int = 0,
    mode: str = "sync",
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    got, metrics, _ = through_server(
        num_workers,
        STEPS,
        mode,
        sync_every=SYNC_EVERY,
        num_fragments=num_fragments,
        fragment_pattern=pattern,
        merge_alpha=alpha,
        overlap_steps=tau,
    )
    return got, metrics


@pytest.mark.parametrize(
    ("num_fragments", "pattern", "alpha", "tau"),
    [
        (2, "sequential", 0.0, 0),
        (3, "strided", 0.5, 0),
        (3, "sequential", 0.5, 0),
        (3, "sequential", 0.5, 1),
        (2, "strided", 0.0, 2),
    ],
)
def test_streaming_workers_match_single_process_streaming_diloco(
    num_fragments: int, pattern: str, alpha: float, tau: int
) -> None:
    expected = reference_streaming(2, num_fragments, pattern, alpha, tau)
    got, metrics = run_through_server(2, num_fragments, pattern, alpha, tau)
    assert set(got) == set(expected)
    assert_same_params(got, expected)
    for m in metrics:
        assert m["fragments_sent"] == num_fragments * PERIODS + num_fragments - 1
        assert m["rounds"] == num_fragments * PERIODS
        assert m["failed_syncs"] == 0 and m["refused_submissions"] == 0
        # One fragment per sync: about 1/P of the model per upload.
        assert m["peak_sync_bytes_up"] < m["bytes_up"] / PERIODS


@pytest.mark.parametrize(("pattern", "alpha", "tau"), [("sequential", 0.5, 0), ("strided", 0.0, 1)])
def test_one_streaming_worker_on_an_async_server_matches_the_reference(
    pattern: str, alpha: float, tau: int
) -> None:
    # With one worker, applying each fragment on arrival (async) is the same arithmetic as a
    # fragment round of one (sync): the async path must land exactly where the reference does.
    expected = reference_streaming(1, 3, pattern, alpha, tau)
    got, (m,) = run_through_server(1, 3, pattern, alpha, tau, mode="async")
    assert_same_params(got, expected)
    assert m["rounds"] == 3 * PERIODS and m["failed_syncs"] == 0


def test_reference_differs_from_plain_and_moves() -> None:
    # Guards against a vacuous pass: the reference trains, and alpha changes the result.
    start = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    a0 = reference_streaming(2, 3, "sequential", 0.0)
    a5 = reference_streaming(2, 3, "sequential", 0.5)
    a5_tau1 = reference_streaming(2, 3, "sequential", 0.5, tau=1)
    assert any(not torch.equal(start[n], a0[n]) for n in start)
    assert any(not torch.equal(a0[n], a5[n]) for n in start)
    assert any(not torch.equal(a5[n], a5_tau1[n]) for n in start)
