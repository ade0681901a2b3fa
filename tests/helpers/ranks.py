"""Worker groups: spawning and joining gloo ranks on 127.0.0.1, leaving the process group, and
the models, batches and single-process references the group tests compare with."""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SYNC_EVERY = 4


ROUNDS = 3


BATCH = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, args: tuple[Any, ...], nprocs: int = 2) -> Any:
    """Start ``fn(rank, port, *args)`` in ``nprocs`` processes; ``join`` the context it returns."""
    return mp.start_processes(
        fn, args=(free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )


def join(ctx: Any, timeout: float) -> None:
    """Wait for every rank; a rank still running at ``timeout`` is a hang: kill and fail."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise AssertionError(f"a rank hung (still running after {timeout:.0f} s)")


def leave() -> None:
    """End a rank: destroy the group, then exit without the interpreter's teardown, where
    torch 2.13's gloo threads sometimes abort the process (SIGABRT, "terminate called without
    an active exception") after all work is done."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_deep_model() -> torch.nn.Module:
    torch.manual_seed(4321)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def make_inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def batches(stream: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + stream)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 6, generator=g)
        out.append((x, torch.sin(x[:, :3] * (stream + 1))))
    return out


def pipeline_step(model: torch.nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step's backward of a two-stage pipeline of the deep model: rank 0 runs the first
    stage and sends its activations, rank 1 the second and the loss, then sends back the
    gradient of the activations (the optimizer step is the caller's)."""
    if rank == 0:
        h = model(x)
        dist.send(h.detach(), 1)
        grad = torch.empty_like(h)
        dist.recv(grad, 1)
        h.backward(grad)
    else:
        h = torch.empty(BATCH, 16)
        dist.recv(h, 0)
        h.requires_grad_()
        torch.nn.functional.mse_loss(model(h), y).backward()
        assert h.grad is not None
        dist.send(h.grad, 0)


def assert_rank0_faults_survived(records: list[dict[str, Any]], status: dict[str, Any]) -> None:
    """Rank 0's records of a run with the scripted faulty client (an unreachable server, then
    a 410 and a re-join at a due step): a failed sync counted, one reconnection by every rank,
    two registrations on the server, a sync kept local and the run ended on the server's."""
    last = records[-1]["metrics"]
    assert last["failed_syncs"] >= 1
    assert last["reconnections"] == 1  # the re-join, made at a due step by every rank
    assert status["registrations"] == 2
    outcomes = [x["outcome"] for x in records]
    assert "kept_local" in outcomes and outcomes[-1] in ("adopted", "rebased")


def reference_groups(
    num_groups: int,
    codec: str | None = None,
    residuals: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Single-process DiLoCo where each group is one worker whose inner step uses the mean
    gradient of its two ranks' batches. ``codec`` (a lossy one): each worker's pseudo-gradient
    goes through it with error feedback, as ``UploadEncoder`` sends it, and the server takes
    the decoded values; ``residuals`` then receives each worker's residual after the last
    round."""
    from diloco.core.codecs import ErrorFeedback
    from diloco.worker.settings import parse_codec

    codecs = [parse_codec(codec) for _ in range(num_groups)] if codec else []
    feedback = [ErrorFeedback() for _ in codecs]
    names = [n for n, _ in make_model().named_parameters()]
    global_model = make_model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [make_model() for _ in range(num_groups)]
    inners = [make_inner(m.parameters()) for m in workers]
    data = [
        list(zip(*(batches(2 * g + r, SYNC_EVERY * ROUNDS) for r in range(2)), strict=True))
        for g in range(num_groups)
    ]
    for r in range(ROUNDS):
        pseudo_grads = []
        for g, (model, inner) in enumerate(zip(workers, inners, strict=True)):
            model.load_state_dict(global_model.state_dict())
            for step in range(SYNC_EVERY):
                halves = data[g][r * SYNC_EVERY + step]
                loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in halves) / 2
                assert isinstance(loss, torch.Tensor)
                loss.backward()
                inner.step()
                inner.zero_grad()
            pg = [
                gp.detach() - p.detach()
                for gp, p in zip(global_model.parameters(), model.parameters(), strict=True)
            ]
            if codecs:  # what the server decodes of the encoded c = g + e
                c, fb = codecs[g], feedback[g]
                pg = [c.decode(fb.encode(c, n, t), t.shape) for n, t in zip(names, pg, strict=True)]
            pseudo_grads.append(pg)
        with torch.no_grad():
            for j, p in enumerate(global_model.parameters()):
                p.grad = torch.stack([pg[j] for pg in pseudo_grads]).sum(0) / num_groups
        outer.step()
        outer.zero_grad()
    if residuals is not None:
        residuals.extend(dict(fb.residuals) for fb in feedback)
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}
