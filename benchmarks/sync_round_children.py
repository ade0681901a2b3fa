"""What runs inside the sync-round benchmark's spawned processes: the model, the server, the workers.

Each child imports torch and diloco only once it runs: the parent never does (which keeps the
fork-before-exec copy of it that each spawned child briefly is small), and the server child can
put another checkout's ``src/`` first on its path (``--server-src``) before its import. A worker
reports on the parent's queue: ``ready``, then per round ``prepared`` (idle until the start) and
``round`` (its stamps, CPU time, byte deltas and parameter checksum), at last ``done``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from harness.rss import base_rss, maxrss, rss

# --- model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    dim: int
    layers: int

    @property
    def numel(self) -> int:
        return self.dim * self.dim * self.layers

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def choose_shape(params: float, max_dim: int) -> ModelShape:
    """Square layers: at most ``max_dim`` wide, at least 4 layers when the model allows it."""
    dim = max(8, min(max_dim, int(math.sqrt(params / 4))))
    layers = max(1, round(params / (dim * dim)))
    return ModelShape(dim, layers)


def build_model(shape: ModelShape, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[torch.nn.Linear(shape.dim, shape.dim, bias=False) for _ in range(shape.layers)]
    )


def estimate_bytes(n: int, model_bytes: int) -> int:
    """What one configuration is expected to need: the server's buffers (about 4x the model with
    bf16 uploads) and each worker's model plus snapshot, with the interpreter and torch (~300 MB
    per process) on top."""
    overhead = 300 * 2**20
    return int(4 * model_bytes + overhead + n * (2.2 * model_bytes + overhead))


# --- child processes: parameter file, server, workers -----------------------------------------


def write_params_main(path: str, shape: ModelShape) -> None:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model = build_model(shape)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, path)


def server_main(
    conn: Any,
    num_workers: int,
    params_path: str,
    threads: int,
    save_every: int = 0,
    server_src: str | None = None,
) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    if server_src:  # another checkout's server (an A/B in one run); the workers stay this one's
        sys.path.insert(0, server_src)
    from diloco.server import DiLoCoServer, ServerConfig

    save_dir = tempfile.mkdtemp(prefix="sync-round-ckpt-") if save_every else None

    base = base_rss()
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        num_workers=num_workers,
        initial_params=params_path,
        # The benchmark's workers send no heartbeats; setup of 16 workers can take minutes.
        heartbeat_timeout=0,
        stuck_timeout=0,
        # Durable rounds: each checkpoint written before its round is sent (keep 1: one on disk).
        save_dir=save_dir,
        save_every=save_every,
        keep_checkpoints=1,
    )
    if save_dir is not None:
        import diloco.server as where

        print(f"server: {where.__file__}, checkpoints every {save_every} round(s)", flush=True)
    server = DiLoCoServer(config).start()
    conn.send(
        {"address": server.address, "base_rss": base, "rss_loaded": rss(), "pid": os.getpid()}
    )
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the parent went away
                return
            if cmd == "status":
                conn.send(server.status())
            elif cmd == "stop":
                status = server.status()
                conn.send({"status": status, "maxrss": maxrss(), "rss_end": rss()})
                return
    finally:
        server.stop(timeout=10)
        if save_dir is not None:
            shutil.rmtree(save_dir, ignore_errors=True)


def worker_main(idx: int, out: Any, *rest: Any) -> None:
    """A worker child (arguments as ``_worker_body``'s): its failure reaches the parent's inbox
    at once, instead of as a barrier timeout minutes later."""
    try:
        _worker_body(idx, out, *rest)
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


def _worker_body(
    idx: int,
    out: Any,
    address: str,
    shape: ModelShape,
    bf16: bool,
    total_rounds: int,
    barrier: Any,
    finished: Any,
    barrier_timeout: float,
) -> None:
    import torch

    torch.set_num_threads(1)
    from diloco import DiLoCoWorker

    base = base_rss()
    model = build_model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + idx)
    noise = torch.empty(min(shape.dim * shape.dim, 1 << 20))  # 4 MB, so it barely shows in RSS
    stamps: dict[str, float] = {}

    with DiLoCoWorker(
        model,
        optimizer,
        address,
        sync_every=10**9,
        bf16_comm=bf16,
        worker_id=f"bench-{idx}",
        heartbeat_interval=0,
    ) as worker:
        # Benchmark-side instrumentation (instance attributes; the library is untouched):
        # when the upload was answered, and when the download body of the new round began.
        submit = worker.client.submit_pseudogradients
        into = worker._local._into_snapshot

        def timed_submit(*a: Any, **k: Any) -> Any:
            reply = submit(*a, **k)
            stamps["submitted"] = time.monotonic()
            return reply

        def timed_into(layout: Any) -> Any:
            stamps["body"] = time.monotonic()
            return into(layout)

        worker.client.submit_pseudogradients = timed_submit  # type: ignore[method-assign]
        worker._local._into_snapshot = timed_into  # type: ignore[method-assign]
        out.put(("ready", idx, {"base_rss": base, "rss_joined": rss()}))

        for r in range(total_rounds):
            with torch.no_grad():  # stand-in for H local steps: a small change to every weight
                for p in model.parameters():
                    flat = p.view(-1)
                    for start in range(0, flat.numel(), noise.numel()):
                        part = flat[start : start + noise.numel()]
                        noise.normal_(0.0, 1e-3, generator=gen)
                        part.add_(noise[: part.numel()])
            before = worker.sync_metrics
            out.put(("prepared", idx, {"round": r}))  # idle from here until the round starts
            barrier.wait(barrier_timeout)
            stamps.clear()
            t0, c0 = time.monotonic(), time.process_time()
            worker.force_sync()
            t1, c1 = time.monotonic(), time.process_time()
            finished.wait(barrier_timeout)
            after = worker.sync_metrics
            with torch.no_grad():
                # fp32 sums (a float64 sum would allocate a float64 copy of each tensor): the
                # same bytes give the same sum, so equal sums say every worker adopted the same
                # parameters.
                checksum = sum(float(p.sum()) for p in model.parameters())
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
            out.put(
                (
                    "round",
                    idx,
                    {
                        "round": r,
                        "t0": t0,
                        "t1": t1,
                        "cpu_s": c1 - c0,
                        "submitted": stamps.get("submitted"),
                        "body": stamps.get("body"),
                        "server_round": after["round"],
                        "checksum": checksum,
                        "delta": delta,
                    },
                )
            )
    out.put(("done", idx, {"maxrss": maxrss(), "rss_end": rss()}))
