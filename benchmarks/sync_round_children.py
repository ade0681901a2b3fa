"""What runs inside the sync-round benchmark's spawned processes: the model, the server, the workers.

Each child imports torch and diloco only once it runs: the parent never does (which keeps the
fork-before-exec copy of it that each spawned child briefly is small), and the server child can
put another checkout's ``src/`` first on its path (``--server-src``) before its import. A worker
reports on the parent's queue: ``ready``, then per round ``prepared`` (idle until the start) and
``round`` (its stamps, CPU time, byte deltas and parameter checksum), at last ``done``.

A communication configuration (``Comm``, ``--comm UP/DOWN``) names the workers' upload codec
(``DiLoCoWorker(codec=UP)``) and the server's ``download_codec`` (DOWN); ``check_comms_main``
checks a list of them in a child, so that the parent still never imports torch or diloco.
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


# --- communication configurations ------------------------------------------------------------

#: Upload codecs that keep no error-feedback residual (``worker/state/encoder.py``).
RAW_CODECS = ("fp32", "bf16")


@dataclass(frozen=True)
class Comm:
    """How a round travels: the workers' upload codec (a ``DiLoCoWorker(codec=...)`` spec such as
    ``int8`` or ``int4:block=32``) and the server's ``download_codec`` (``fp32``: full
    parameters every round; ``bf16``, ``int8``, ``int4``: each round as a compressed update)."""

    up: str
    down: str

    @property
    def label(self) -> str:
        return f"{self.up}/{self.down}"

    @property
    def lossy_up(self) -> bool:
        return self.up.partition(":")[0].strip() not in RAW_CODECS

    @property
    def lossy_down(self) -> bool:
        return self.down != "fp32"


def parse_comm(spec: str) -> Comm:
    """``UP/DOWN`` as a ``Comm`` (syntax only; ``check_comms_main`` checks the names)."""
    up, sep, down = (x.strip() for x in spec.strip().partition("/"))
    if not sep or not up or not down or "/" in down:
        raise ValueError(f"--comm {spec!r}: expected UP/DOWN, e.g. bf16/fp32 or int8/int8")
    return Comm(up, down)


def check_comms_main(conn: Any, comms: list[Comm]) -> None:
    """A child: sends back one line per configuration this checkout's worker or server would
    refuse (an empty list when all are fine)."""
    from diloco.server.config import DOWNLOAD_CODECS, ServerConfig
    from diloco.worker.settings import parse_codec

    allowed = ServerConfig().allowed_codecs
    errors = []
    for c in comms:
        try:
            name = parse_codec(c.up).name
            if name not in allowed:
                errors.append(f"{c.label}: the server allows uploads in {', '.join(allowed)} only")
        except ValueError as exc:
            errors.append(f"{c.label}: {exc}")
        if c.down not in DOWNLOAD_CODECS:
            errors.append(f"{c.label}: the downlink must be one of {', '.join(DOWNLOAD_CODECS)}")
    conn.send(errors)


def estimate_bytes(n: int, model_bytes: int, comm: Comm | None = None) -> int:
    """What one configuration is expected to need: the server's buffers (about 4x the model with
    bf16 uploads, one more fp32 copy with a compressed downlink) and each worker's model plus
    snapshot (plus an fp32 error-feedback residual with a lossy upload codec), with the
    interpreter and torch (~300 MB per process) on top."""
    overhead = 300 * 2**20
    server = 4 + (1 if comm is not None and comm.lossy_down else 0)
    worker = 2.2 + (1 if comm is not None and comm.lossy_up else 0)
    return int(server * model_bytes + overhead + n * (worker * model_bytes + overhead))


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
    download_codec: str = "fp32",
) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    if server_src:  # another checkout's server (an A/B in one run); the workers stay this one's
        sys.path.insert(0, server_src)
    from diloco.server import DiLoCoServer, ServerConfig

    save_dir = tempfile.mkdtemp(prefix="sync-round-ckpt-") if save_every else None

    base = base_rss()
    # Named only when compressed, so that a --server-src checkout from before codecs still runs.
    codec: dict[str, Any] = {"download_codec": download_codec} if download_codec != "fp32" else {}
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
        **codec,
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
    codec: str,
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
        codec=codec,
        worker_id=f"bench-{idx}",
        heartbeat_interval=0,
    ) as worker:
        # Benchmark-side instrumentation (instance attributes; the library is untouched):
        # when the upload was answered, and when the download body of the new round began
        # (full parameters, or a compressed downlink's update).
        submit = worker.client.submit_pseudogradients
        into = worker._local._into_snapshot
        into_update = getattr(worker._local, "_into_update", None)

        def timed_submit(*a: Any, **k: Any) -> Any:
            reply = submit(*a, **k)
            stamps["submitted"] = time.monotonic()
            return reply

        def timed_into(layout: Any) -> Any:
            stamps["body"] = time.monotonic()
            return into(layout)

        def timed_into_update(layout: Any) -> Any:
            stamps["body"] = time.monotonic()
            assert into_update is not None
            return into_update(layout)

        worker.client.submit_pseudogradients = timed_submit  # type: ignore[method-assign]
        worker._local._into_snapshot = timed_into  # type: ignore[method-assign]
        if into_update is not None:
            worker._local._into_update = timed_into_update  # type: ignore[method-assign]
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
