"""Memory and round time of sharded worker groups (FSDP2) against replicated ones (DDP).

Two groups of two gloo ranks each (four processes, each group its own ``torch.distributed``
world, one torch thread per process) train the same model, bias-free square ``nn.Linear``
layers, with AdamW, against one server in this process (``num_workers=2``, loopback):

* ``ddp``: every rank holds the whole model under ``DistributedDataParallel``;
* ``fsdp``: ``fully_shard`` on every layer and at the root over a 1-D CPU mesh of the group's
  two ranks, so each rank holds half of every parameter, of its gradient and of AdamW's state.

``--allreduce``: the server runs in all-reduce mode and the groups average among themselves.
There ``fsdp`` groups exchange shard with shard (rank r with rank r), and a third set-up,
``fsdp-rank0``, is the same run with the layout check made to disagree (each group's mark
changed in this benchmark only), so the groups take the path a mixed quorum takes: every
parameter through each rank 0, one at a time.

Each rank takes a few inner steps, then ``force_sync()`` after a barrier of its group; one
warm-up round, then ``--repeats`` timed. Memory: each rank's base is its RSS after imports,
its process group and one tiny optimizer (``harness/rss.base_rss``), before the model exists;
the figures are its peak RSS (``ru_maxrss``) above that base, beside what the model's own training
keeps on that rank (its parameters, gradients and AdamW's two moments: 4 x its share of the fp32
parameters), and the RSS ``DiLoCoWorker.start()`` adds (its snapshot: one more share, three in all-reduce mode
with the momentum and the averaging buffer; on rank 0 of
a sharded group, staging buffers bounded by the largest parameter come with the syncs). The
peak also holds what the framework allocates on the way (FSDP2 on CPU all-gathers each layer
for forward and backward, and glibc keeps much of what is freed), so it is an upper bound on
DiLoCo's part, not a measure of it.

Usage: ``.venv/bin/python -m benchmarks.training.sharded_groups [--params 100e6] [--repeats 3]
[--allreduce]``;
``--smoke``: 2M parameters, one round per set-up, checked.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table
from benchmarks.harness.rss import base_rss, maxrss, rss
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig

WIDTH = 1000
INNER_STEPS = 2
BATCH = 8
MB = 1e6


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def _through_rank0(group: int) -> None:
    """``fsdp-rank0``: each group's layout mark differs, so the quorum takes the streamed path."""
    from diloco.worker.allreduce import sharded_whole

    check = sharded_whole.same_layout

    def differing(quorum: Any, mark: str) -> bool:
        return check(quorum, f"{int(mark, 16) ^ (group + 1):08x}")

    sharded_whole.same_layout = differing


def _wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_numel(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel()
    return total


def _rank(
    index: int,
    mode: str,
    ports: list[int],
    server: str,
    layers: int,
    width: int,
    repeats: int,
    out: Any,
) -> None:
    group, rank = divmod(index, 2)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{ports[group]}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=1200),
    )
    base = base_rss()
    if mode == "fsdp-rank0":
        _through_rank0(group)
    model = _wrap(_model(layers, width), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(100 * group + rank)
    walls: list[float] = []
    before = rss()
    with DiLoCoWorker(model, opt, server, sync_every=10**9, heartbeat_interval=0) as worker:
        at_start = rss() - before  # the snapshot of what this rank holds, and small state
        for i in range(repeats + 1):
            for _ in range(INNER_STEPS):
                x = torch.randn(BATCH, width, generator=data)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            worker.force_sync()
            if i > 0:  # the first round is the warm-up
                walls.append(time.perf_counter() - t0)
        worker.stop(submit=False)
    out.put(
        {
            "group": group,
            "rank": rank,
            "walls": walls,
            "peak_above_base": maxrss() - base,
            "at_start": at_start,
            "local_params": _local_numel(model),
        }
    )
    out.close()
    out.join_thread()  # flushed before os._exit below
    dist.destroy_process_group()
    # torch 2.13's gloo threads sometimes abort the interpreter's teardown: skip it.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(mode: str, params: float, repeats: int, allreduce: bool) -> dict[str, Any]:
    layers = max(2, round(params / WIDTH**2))
    config = ServerConfig(port=0, num_workers=2, allreduce=allreduce, collective_timeout=600.0)
    with DiLoCoServer(config) as server:
        out = mp.get_context("spawn").Queue()
        args = (mode, [_free_port(), _free_port()], server.address, layers, WIDTH, repeats, out)
        procs = mp.start_processes(_rank, args=args, nprocs=4, join=False, start_method="spawn")
        results = [out.get(timeout=3600) for _ in range(4)]
        procs.join()
    results.sort(key=lambda r: (r["group"], r["rank"]))
    return {"mode": mode, "params": layers * WIDTH**2, "ranks": results}


def _report(results: list[dict[str, Any]], allreduce: bool) -> None:
    # What DiLoCo keeps per share held: the snapshot; in all-reduce mode also the outer
    # momentum and the averaging buffer.
    kept = 3 if allreduce else 1
    print(
        f"model: {results[0]['params'] / 1e6:.1f}M fp32 parameters in {WIDTH}x{WIDTH} layers, "
        f"2 groups x 2 gloo ranks, AdamW, bf16 on the wire, {INNER_STEPS} inner steps per "
        f"round, {'all-reduce' if allreduce else 'server'} mode, "
        f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    )
    rows = []
    medians = {}
    for r in results:
        walls = [w for rank in r["ranks"] for w in rank["walls"] if rank["rank"] == 0]
        medians[r["mode"]] = statistics.median(walls)
        for rank in r["ranks"]:
            share = rank["local_params"] * 4
            peak = rank["peak_above_base"]
            rows.append(
                [
                    r["mode"],
                    f"{rank['group']}/{rank['rank']}",
                    f"{share / MB:.0f}",
                    f"{4 * share / MB:.0f}",
                    f"{rank['at_start'] / MB:.0f}",
                    f"{peak / MB:.0f}",
                    f"{peak / ((4 + kept) * share):.2f}",
                    f"{statistics.median(rank['walls']) * 1000:.0f}",
                ]
            )
    print_table(
        [
            "set-up",
            "group/rank",
            "params held MB",
            "4 x held (params, grads, AdamW) MB",
            "RSS added by start() MB",
            "peak above base MB",
            f"peak / (4 x held + {kept} x held)",
            "round median ms",
        ],
        rows,
    )
    for mode in ("fsdp", "fsdp-rank0"):
        if "ddp" in medians and mode in medians:
            print(f"round time {mode} / ddp: {medians[mode] / medians['ddp']:.2f}x")


def _check(results: list[dict[str, Any]], modes: list[str], repeats: int) -> None:
    smoke.require([r["mode"] for r in results] == modes, "every set-up ran")
    for r in results:
        smoke.require(len(r["ranks"]) == 4, f"{r['mode']}: four ranks reported")
        for rank in r["ranks"]:
            smoke.require(len(rank["walls"]) == repeats, f"{r['mode']}: rounds timed")
            smoke.require(rank["peak_above_base"] > 0, f"{r['mode']}: memory measured")
    for fsdp in (r for r in results if r["mode"].startswith("fsdp")):
        held = [rank["local_params"] for rank in fsdp["ranks"]]
        smoke.require(sum(held[:2]) == fsdp["params"], "fsdp: each group's shards tile it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--allreduce", action="store_true", help="the server in all-reduce mode")
    ap.add_argument("--modes", nargs="+", choices=["ddp", "fsdp", "fsdp-rank0"])
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.modes is None:
        args.modes = ["ddp", "fsdp", "fsdp-rank0"] if args.allreduce else ["ddp", "fsdp"]
    if "fsdp-rank0" in args.modes and not args.allreduce:
        ap.error("fsdp-rank0 is an all-reduce set-up: add --allreduce")
    if args.smoke:
        args.params, args.repeats = 2e6, 1
    # glibc's mmap threshold otherwise rises after the first large free, and later blocks of that
    # size stay in the heap after they are freed: the peaks would depend on the order of frees.
    # Fixed here (read by each rank at its start), the same for both set-ups.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    sets = [(args.allreduce, args.modes)]
    if args.smoke:  # both modes' paths, each set-up once
        sets = [(False, ["ddp", "fsdp"]), (True, ["fsdp", "fsdp-rank0"])]
    for allreduce, modes in sets:
        results = [run(mode, args.params, args.repeats, allreduce) for mode in modes]
        _report(results, allreduce)
        if args.smoke:
            _check(results, modes, args.repeats)
    if args.smoke:
        smoke.passed("sharded_groups")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
