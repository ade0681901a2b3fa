"""The extra cost of a worker-group sync over a single-process sync of the same model.

A model of P fp32 parameters (bias-free square ``nn.Linear`` layers) syncs with a server in this
process (``num_workers=1``, loopback) in three set-ups, each in freshly spawned processes with
one torch thread:

* ``single``: one process, one ``DiLoCoWorker``;
* ``replicated``: two gloo ranks holding the same model (as under DDP), one worker group;
* ``partitioned``: two gloo ranks each owning half the layers (pipeline stages).

Each sync perturbs the parameters in place (standing in for local training; the same noise on
every rank of a replicated group) and times ``force_sync()`` on each rank after a barrier; one
warm-up sync, then the median of ``--repeats``. The figure is rank 0's; rank 1's (when it is
back in training) is printed beside it. The group's phases are timed by wrapping
``WorkerGroup``'s collectives and rank 0's HTTP sync (which includes the part of the streamed
broadcast sent while the download lands): where the extra time goes.

Usage: ``.venv/bin/python -m benchmarks.training.group_sync [--params 25e6] [--repeats 5]``;
``--smoke``: 2M parameters, one sync per set-up, checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.groups import group as group_mod
from diloco.worker.groups.group_sync import GroupSync

WIDTH = 1000
PHASES = {
    "pool_counts": "samples and tokens all_reduce",
    "collect": "gather (partitioned)",
    "send_report": "report broadcast",
    "receive_report": "report broadcast",
    "share": "parameters broadcast/scatter",
    "stream_end": "rest of streamed broadcast",
    "stream_receive": "streamed broadcast received",
    "stream_apply": "receive buffers -> parameters",
}


def _model(layers: int, owned: range | None) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]
    if owned is not None:
        mods = [m if i in owned else torch.nn.Identity() for i, m in enumerate(mods)]
    return torch.nn.Sequential(*mods)


def _timed(times: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] += time.perf_counter() - t0

    return wrapper


def _rank(
    rank: int, mode: str, world: int, port: int, server: str, layers: int, repeats: int, out: Any
) -> None:
    torch.set_num_threads(1)
    times: dict[str, float] = defaultdict(float)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=600),
        )
        for name in PHASES:
            meth = getattr(group_mod.WorkerGroup, name)
            setattr(group_mod.WorkerGroup, name, _timed(times, name, meth))
        inner = GroupSync._sync_on_leader
        GroupSync._sync_on_leader = _timed(times, "http", inner)  # type: ignore[method-assign]
    half = layers // 2
    owned = None if mode != "partitioned" else (range(half) if rank == 0 else range(half, layers))
    model = _model(layers, owned)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = torch.Generator().manual_seed(1)
    walls = []
    with DiLoCoWorker(model, opt, server, sync_every=10**9, heartbeat_interval=0) as worker:
        for i in range(repeats + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=noise), alpha=1e-3)
            if world > 1:
                dist.barrier()
            if i == 1:
                times.clear()  # the warm-up sync is not counted
            t0 = time.perf_counter()
            if world > 1:
                worker.force_sync()
            else:
                t_http = time.perf_counter()
                worker.force_sync()
                times["http"] += time.perf_counter() - t_http
            if i > 0:
                walls.append(time.perf_counter() - t0)
        worker.stop(submit=False)
    out.put({"rank": rank, "walls": walls, "phases": {k: v / repeats for k, v in times.items()}})
    out.close()
    out.join_thread()  # flushed before os._exit below
    if world > 1:
        dist.destroy_process_group()
    # torch 2.13's gloo threads sometimes abort the interpreter's teardown: skip it.
    os._exit(0)


def run(mode: str, params: float, repeats: int) -> dict[str, Any]:
    layers = max(2, round(params / WIDTH**2))
    world = 1 if mode == "single" else 2
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = (mode, world, port, server.address, layers, repeats, out)
        procs = mp.start_processes(_rank, args=args, nprocs=world, join=False, start_method="spawn")
        results = sorted((out.get(timeout=1200) for _ in range(world)), key=lambda r: r["rank"])
        procs.join()
    result: dict[str, Any] = results[0]
    result["others"] = results[1:]
    result["params"] = layers * WIDTH**2
    return result


def _phases(phases: dict[str, float]) -> str:
    """A rank's phases, longest first, in ms."""
    return ", ".join(
        f"{'HTTP sync (rank 0)' if name == 'http' else PHASES.get(name, name)} {sec * 1000:.1f}"
        for name, sec in sorted(phases.items(), key=lambda kv: -kv[1])
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["single", "replicated", "partitioned"])
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.repeats = 2e6, 1
    results = {mode: run(mode, args.params, args.repeats) for mode in args.modes}
    base = statistics.median(results["single"]["walls"]) if "single" in results else None
    print(f"model: {results[args.modes[0]]['params'] / 1e6:.1f}M fp32 parameters, bf16 uploads")
    rows = []
    for mode, r in results.items():
        median = statistics.median(r["walls"])
        ratio = f"{median / base:.2f}x" if base else "-"
        rows.append([mode, "0", f"{median * 1000:.0f}", ratio, _phases(r["phases"])])
        for other in r["others"]:
            rank_median = statistics.median(other["walls"]) * 1000
            rows.append(
                [mode, str(other["rank"]), f"{rank_median:.0f}", "", _phases(other["phases"])]
            )
    print_table(["set-up", "rank", "sync median ms", "vs single", "where the time goes, ms"], rows)
    if args.smoke:
        smoke.require(set(results) == set(args.modes), "every set-up ran")
        for mode, r in results.items():
            smoke.require(len(r["walls"]) == args.repeats, f"{mode}: every sync timed")
            smoke.require(all(w > 0 for w in r["walls"]), f"{mode}: syncs took time")
        smoke.passed("group_sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
