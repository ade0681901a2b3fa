"""What runs inside the sync-round benchmark's spawned workers, and its communication settings.

The model is ``harness.model``'s and the server ``harness.server_child``'s. Each child imports
torch and diloco only once it runs: the parent never does (which keeps the fork-before-exec copy
of it that each spawned child briefly is small). A worker reports on the parent's queue: ``ready``, then per round ``prepared`` (idle until the start) and
``round`` (its stamps, CPU time, byte deltas and parameter checksum), at last ``done``.

A communication configuration (``Comm``, ``--comm UP/DOWN``) names the workers' upload codec
(``DiLoCoWorker(codec=UP)``) and the server's ``download_codec`` (DOWN); ``check_comms_main``
checks a list of them in a child, so that the parent still never imports torch or diloco.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.model import ModelShape, build_model, checksum, noise_buffer, perturb
from benchmarks.harness.rss import base_rss, maxrss, rss
from benchmarks.harness.session import run_member

# --- communication configurations ------------------------------------------------------------

#: Upload codecs that keep no error-feedback residual (``worker/state/encoder.py``).
RAW_CODECS = ("fp32", "bf16")


@dataclass(frozen=True)
class Comm:
    """How a round travels: the workers' upload codec (a ``DiLoCoWorker(codec=...)`` spec such as
    ``int8`` or ``int4:block=32``) and the server's ``download_codec`` (``fp32``: full
    parameters every round; ``bf16``, ``int8``, ``int4``: each round as a compressed update;
    ``sparse``: as the positions it changed, with their new values)."""

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

    @property
    def true_copy(self) -> bool:
        """The server keeps one more fp32 copy (a compressed downlink; not the sparse one)."""
        return self.down not in ("fp32", "sparse")


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
    server = 4 + (1 if comm is not None and comm.true_copy else 0)
    worker = 2.2 + (1 if comm is not None and comm.lossy_up else 0)
    return int(server * model_bytes + overhead + n * (worker * model_bytes + overhead))


# --- the workers ----------------------------------------------------------------------------


def stamp_server_sync(worker: Any, mark: Callable[[str], None]) -> None:
    """Benchmark-side instrumentation of a server-mode sync (instance attributes; the library is
    untouched): ``mark("submitted")`` when the upload was answered, ``mark("body")`` when the
    download body of the new round began (full parameters, or a compressed downlink's update)."""
    submit = worker.client.submit_pseudogradients
    into = worker._local._into_snapshot
    into_update = getattr(worker._local, "_into_update", None)

    def timed_submit(*a: Any, **k: Any) -> Any:
        reply = submit(*a, **k)
        mark("submitted")
        return reply

    def timed_into(layout: Any) -> Any:
        mark("body")
        return into(layout)

    def timed_into_update(layout: Any) -> Any:
        mark("body")
        assert into_update is not None
        return into_update(layout)

    worker.client.submit_pseudogradients = timed_submit
    worker._local._into_snapshot = timed_into
    if into_update is not None:
        worker._local._into_update = timed_into_update


def worker_main(idx: int, out: Any, *rest: Any) -> None:
    """A worker child (arguments as ``_worker_body``'s)."""
    run_member(_worker_body, idx, out, *rest)


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
    cprofile: tuple[int, str] | None = None,
) -> None:
    import torch

    torch.set_num_threads(1)
    from diloco import DiLoCoWorker

    base = base_rss()
    model = build_model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + idx)
    noise = noise_buffer(shape)  # 4 MB, so it barely shows in RSS
    stamps: dict[str, float] = {}

    def mark(what: str) -> None:
        stamps[what] = time.monotonic()

    with DiLoCoWorker(
        model,
        optimizer,
        address,
        sync_every=10**9,
        codec=codec,
        worker_id=f"bench-{idx}",
        heartbeat_interval=0,
    ) as worker:
        stamp_server_sync(worker, mark)
        out.put(("ready", idx, {"base_rss": base, "rss_joined": rss()}))

        for r in range(total_rounds):
            perturb(model, noise, gen)  # stand-in for H local steps
            before = worker.sync_metrics
            out.put(("prepared", idx, {"round": r}))  # idle from here until the round starts
            barrier.wait(barrier_timeout)
            stamps.clear()
            prof, prof_path = None, ""
            if cprofile is not None and idx == 0 and r >= cprofile[0]:  # measured rounds only
                prof, prof_path = (
                    cProfile.Profile(),
                    os.path.join(cprofile[1], f"worker0-round{r}.prof"),
                )
                prof.enable()
            t0, c0 = time.monotonic(), time.process_time()
            worker.force_sync()
            t1, c1 = time.monotonic(), time.process_time()
            if prof is not None:
                prof.disable()
                prof.dump_stats(prof_path)
            finished.wait(barrier_timeout)
            after = worker.sync_metrics
            total = checksum(model)  # equal sums: every worker adopted the same parameters
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
                        "checksum": total,
                        "delta": delta,
                    },
                )
            )
    out.put(("done", idx, {"maxrss": maxrss(), "rss_end": rss()}))
