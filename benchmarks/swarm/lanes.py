"""Lanes: L independent pinned pipelines of the demo swarm through one coordinator, every peer
in a process of its own; the throughput of L lanes against one lane (issue 29's scaling run).

    python -m benchmarks.swarm.lanes --lanes 1,2,1 --steps 300
    python -m benchmarks.swarm.lanes --smoke        # a few steps of 1 and 2 lanes, checked

A lane is a head (the driver), a stage-1 and a stage-2 replica of the demo model
(``demo_swarm``: 3 stages, no stage sync), each a spawned child with one torch thread, all
joined through one in-process ``--swarm`` coordinator. A lane's head sends only to its own
lane's replicas (``StaticRoutes`` in place of the coordinator's routes): lanes share the
coordinator and the machine, nothing else. Each head trains ``--steps`` steps on batches of
its own (seed + lane), the first ``--warmup`` untimed; the timed part starts at one barrier for
all heads, so the lanes' steps overlap, and the run's throughput is the samples of every lane
over the slowest lane's time, against the faster of the one-lane runs. Each serving replica
reports how many steps it took (a pinned lane's replicas step once per driver step, never on
another lane's samples).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import (
    machine_info,
    now,
    print_machine,
    print_table,
    run_head,
    write_json,
)
from benchmarks.swarm.demo_swarm import STAGES, TOKEN, Setup, make_peer, start_server

JOIN_S = 180.0
"""Spawned children import torch and diloco first: many at once on a busy 2-core machine."""


def _quiet() -> None:
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)


def _serve(address: str, lane: int, k: int, setup: Setup, stop: Any, out: Any) -> None:
    """A child: stage ``k`` of lane ``lane``; says its port, serves until ``stop``, then says
    how many steps it took."""
    _quiet()
    peer = make_peer(address, k, setup).start()
    try:
        assert peer.service is not None
        out.put(("port", lane, k, peer.service.port))
        stop.wait()
        peer.service.drain()
        out.put(("steps", lane, k, int(peer.service.stats()["steps"])))
    finally:
        peer.stop()


def _drive(address: str, lane: int, ports: dict[int, int], args: Any, go: Any, out: Any) -> None:
    """A child: lane ``lane``'s head, pinned to its lane's replicas; its timed seconds."""
    _quiet()
    from benchmarks.swarm.demo_swarm import batches
    from diloco.demo.data import build_corpus
    from diloco.swarm import Endpoint, StaticRoutes

    setup = Setup(seed=args.seed, batch=args.batch, micro_batch=args.micro, in_flight=args.flight)
    data = batches(build_corpus(1).shards[0], args.steps, args.batch, args.seed + lane)
    peer = make_peer(address, 0, setup).start()
    try:
        assert peer.driver is not None
        peer.driver.routes = StaticRoutes(
            {k: [Endpoint(f"http://127.0.0.1:{port}", TOKEN)] for k, port in ports.items()}
        )
        losses = [peer.train_step(x, y) for x, y in data[: args.warmup]]
        go.wait(JOIN_S)  # every lane's head is warm: the timed steps overlap
        t0 = time.perf_counter()
        losses += [peer.train_step(x, y) for x, y in data[args.warmup :]]
        out.put(("done", lane, time.perf_counter() - t0, losses[-1]))
    finally:
        peer.stop()


def _get(out: Any, kind: str, n: int, children: list[Any]) -> list[tuple[Any, ...]]:
    """``n`` messages of ``kind`` from the children; fails if one of them died first."""
    got: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + JOIN_S
    while len(got) < n:
        try:
            msg = out.get(timeout=1.0)
        except queue.Empty:
            dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"lanes: waiting for {kind}, children exited {dead}") from None
            continue
        assert msg[0] == kind, msg
        got.append(msg)
    return got


def run_lanes(args: Any, lanes: int) -> dict[str, Any]:
    """``lanes`` pinned pipelines through one coordinator; the run's figures."""
    ctx = mp.get_context("spawn")
    server = start_server()
    stop, out, go = ctx.Event(), ctx.Queue(), ctx.Barrier(lanes)
    setup = Setup(seed=args.seed, batch=args.batch, micro_batch=args.micro, in_flight=args.flight)
    servers = [
        ctx.Process(target=_serve, args=(server.address, lane, k, setup, stop, out))
        for lane in range(lanes)
        for k in range(1, STAGES)
    ]
    heads: list[Any] = []
    try:
        for c in servers:
            c.start()
        ports: dict[int, dict[int, int]] = {lane: {} for lane in range(lanes)}
        for _, lane, k, port in _get(out, "port", len(servers), servers):
            ports[lane][k] = port
        heads = [
            ctx.Process(target=_drive, args=(server.address, lane, ports[lane], args, go, out))
            for lane in range(lanes)
        ]
        for c in heads:
            c.start()
        done = sorted(_get(out, "done", lanes, servers + heads))
        stop.set()
        steps = sorted(_get(out, "steps", len(servers), servers))
    finally:
        stop.set()
        for c in servers + heads:
            c.join(JOIN_S)
            if c.is_alive():
                c.kill()
                c.join()
        server.stop()
    timed = (args.steps - args.warmup) * args.batch
    slowest = max(seconds for _, _, seconds, _ in done)
    return {
        "lanes": lanes,
        "samples_s": lanes * timed / slowest,
        "lane_samples_s": [timed / seconds for _, _, seconds, _ in done],
        "last_loss": [loss for _, _, _, loss in done],
        "replica_steps": {f"{lane}/{k}": n for _, lane, k, n in steps},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lanes",
        default="1,2,1",
        help="lane counts to run in order, comma separated (one lane before and after: the "
        "machine is shared, the two bracket the others)",
    )
    ap.add_argument("--steps", type=int, default=300, help="steps per lane")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=16, help="samples a micro-batch")
    ap.add_argument("--flight", type=int, default=1, help="micro-batches in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/swarm_lanes.json")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.lanes = 4, 1, "1,2"
    counts = [int(v) for v in args.lanes.split(",")]
    date, machine = now(), machine_info()
    print(f"# Pipeline swarm lanes, {date}", flush=True)
    print_machine(machine)
    print(
        f"one torch thread a process; {args.steps} steps a lane (first {args.warmup} untimed), "
        f"batch {args.batch}, micro-batch {args.micro}, {args.flight} in flight, int8\n"
    )
    rows = [run_lanes(args, n) for n in counts]
    # The faster one-lane run is the base: a shared machine only ever slows a run down.
    base = max((r["samples_s"] for r in rows if r["lanes"] == 1), default=rows[0]["samples_s"])
    print_table(
        ["lanes", "processes", "samples/s (all lanes)", "x one lane", "each lane's samples/s"],
        [
            [
                str(r["lanes"]),
                str(r["lanes"] * STAGES),
                f"{r['samples_s']:.0f}",
                f"{r['samples_s'] / base:.2f}",
                ", ".join(f"{v:.0f}" for v in r["lane_samples_s"]),
            ]
            for r in rows
        ],
    )
    if args.smoke:
        smoke.require(
            all(r["samples_s"] > 0 and all(v == v for v in r["last_loss"]) for r in rows),
            "every lane trained, finite losses",
        )
        smoke.require(
            all(set(r["replica_steps"].values()) == {args.steps} for r in rows),
            f"every replica stepped once per step of its own lane: {[r['replica_steps'] for r in rows]}",
        )
        smoke.passed("swarm.lanes")
        return
    write_json(
        args.out, {**run_head("swarm_lanes", date, machine), "args": vars(args), "runs": rows}
    )


if __name__ == "__main__":
    main()
