"""Bytes between regions per round (issue 31 item 4): every worker of every region syncing
with one central server, against one relay per region (``diloco server --upstream``) syncing
with it for them.

Each region's traffic to the central server goes through its own listener of a counting proxy
(``harness/counting_proxy.py``): in the flat run the region's workers connect through it, in the
relay run the region's relay does. Servers and workers run in this process (loopback); workers
take a constant-gradient inner step (the bytes do not depend on the training), upload in
``--codec`` (a relay uploads its region's mean in the same codec) and download fp32
parameters. Per run: bytes per round across all inter-region links, each way, as MB and in
models; and whether the relay run's parameters equal the flat run's (equal regions: the
upstream's mean of the regions' means is the mean of every worker's; tolerance from the codec).

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.links.relay_bytes --regions 2 --per-region 4
    .venv/bin/python -m benchmarks.links.relay_bytes --smoke
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from contextlib import ExitStack
from typing import Any

import torch

from benchmarks.harness import smoke
from benchmarks.harness.counting_proxy import CountingProxy, diff
from benchmarks.harness.report import (
    machine_info,
    now,
    print_machine,
    print_table,
    run_head,
    times_model,
    write_json,
)
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig

G = 0.001  # the constant inner gradient


def make_model(params: int) -> torch.nn.Module:
    width = max(8, int(params**0.5))
    torch.manual_seed(0)
    return torch.nn.Linear(width, width, bias=False)


def steps(worker: DiLoCoWorker, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.full_like(p, G)
        opt.step()
        opt.zero_grad()
    worker.stop()


def wait_for(what: str, ready: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run: ``flat`` (workers to the central server) or ``relay`` (a relay per region).
    Relays and workers join first (one model down each across the link: the relays in the relay
    run, the workers in the flat run); the bytes of the rounds are counted from then on."""
    names = [f"region{k}" for k in range(args.regions)]
    total = args.regions * args.per_region
    start = {n: p.detach().clone() for n, p in make_model(args.params).named_parameters()}
    with ExitStack() as stack:
        proxy = CountingProxy(mp.get_context("spawn"), names)  # a proxy is pointed once
        stack.callback(proxy.stop)
        expected = total if mode == "flat" else args.regions
        up = stack.enter_context(
            DiLoCoServer(ServerConfig(port=0, num_workers=expected), initial_params=start)
        )
        proxy.point_at({n: ("127.0.0.1", up.port) for n in names})
        links = {n: "{}:{}".format(*proxy.address(n)) for n in names}
        joined = proxy.counts()
        targets = [links[n] for n in names]
        if mode == "relay":
            relays = [
                stack.enter_context(
                    DiLoCoServer(
                        ServerConfig(
                            port=0, num_workers=args.per_region, upstream=links[n],
                            upstream_codec=args.codec,
                        )
                    )
                )
                for n in names
            ]  # fmt: skip
            for relay in relays:  # its parameters from the upstream before any worker joins
                wait_for("a relay's parameters", lambda r=relay: r.status()["has_params"])
            targets = [r.address for r in relays]
        models = [make_model(args.params) for _ in range(total)]
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
        workers = [
            DiLoCoWorker(
                m, o, targets[i // args.per_region], sync_every=args.sync_every, codec=args.codec,
                worker_id=f"w{i}", heartbeat_interval=0,
            ).start()
            for i, (m, o) in enumerate(zip(models, opts, strict=True))
        ]  # fmt: skip
        before = proxy.counts()
        threads = [
            threading.Thread(target=steps, args=(w, m, o, args.rounds * args.sync_every))
            for w, m, o in zip(workers, models, opts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        after = proxy.counts()
        params = up.global_params()
        rounds = up.status()["round"]
    join, moved = diff(before, joined), diff(after, before)
    return {
        "mode": mode,
        "rounds": rounds,
        "join_down": sum(join[n]["out"] for n in names),
        "up": sum(moved[n]["in"] for n in names),
        "down": sum(moved[n]["out"] for n in names),
        "params": params,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--per-region", type=int, default=4, help="workers in each region")
    ap.add_argument("--params", type=int, default=4_000_000, help="model parameters (about)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--codec", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", default="benchmarks/results/relay_bytes.json")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.per_region, args.params, args.rounds, args.out = 2, 20_000, 2, None
    date, machine = now(), machine_info()
    print(f"# relay bytes, {date}")
    print_machine(machine)
    model_bytes = 4 * sum(p.numel() for p in make_model(args.params).parameters())
    runs = [run(mode, args) for mode in ("flat", "relay")]
    flat, relay = runs
    atol = 1e-6 if args.codec == "fp32" else 1e-2 * G * args.sync_every
    same = all(
        torch.allclose(flat["params"][n], relay["params"][n], rtol=0, atol=atol)
        for n in flat["params"]
    )
    rows = [
        [
            r["mode"],
            str(args.regions),
            str(args.per_region),
            str(r["rounds"]),
            times_model(r["join_down"], model_bytes),
            times_model(r["up"] / r["rounds"], model_bytes),
            times_model(r["down"] / r["rounds"], model_bytes),
        ]
        for r in runs
    ]
    print(f"\nmodel {model_bytes / 1e6:.1f} MB fp32, uploads {args.codec}; MB across all "
          "inter-region links (in models): once to join, then per round each way")  # fmt: skip
    print_table(["run", "regions", "workers/region", "rounds", "join (down)", "up", "down"], rows)
    print(f"relay run ends where the flat run does: {same}")
    ratio = (flat["up"] + flat["down"]) / (relay["up"] + relay["down"])
    print(f"inter-region bytes, flat / relay: {ratio:.2f}x")
    if args.smoke:
        smoke.require(flat["rounds"] == relay["rounds"] == args.rounds, "every round closed")
        smoke.require(same, "the relay run equals the flat run")
        smoke.require(ratio > 0.9 * args.per_region, "relays cut the bytes per worker per region")
        smoke.passed("links.relay_bytes")
        return
    doc = run_head("relay_bytes", date, machine)
    doc.update(
        vars(args),
        model_bytes=model_bytes,
        runs=[{k: v for k, v in r.items() if k != "params"} for r in runs],
        same_params=same,
        ratio=ratio,
    )
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
