"""Chaos run: train the demo model while killing (SIGKILL) and restarting workers and the server.

    python -m benchmarks.faults.chaos --workers 3 --steps 600 --seed 0
    python -m benchmarks.faults.chaos --smoke     # 2 workers, a few kills, checked

Runs the same training twice: once fault-free, once with random kills (seeded), and prints rounds
completed, worker deaths seen by the server, worker reconnections, restarts, and the held-out loss
of the final global model in both runs. Not part of the test suite: it takes minutes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.server_process import ServerProcess


def _worker(rank: int, cfg: dict[str, Any], address: str, progress: Any, out: Any) -> None:
    """Trains until the shared step counter of its slot reaches cfg['steps']."""
    import logging

    import torch

    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, loss_on
    from diloco.worker import DiLoCoClient, DiLoCoWorker

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    tokens = build_corpus(cfg["workers"]).shards[rank]
    model = build_model(cfg["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(cfg["seed"] * 100 + rank * 7 + progress[rank])
    client = DiLoCoClient(address, retries=8, backoff=0.2, max_backoff=2.0, read_timeout=30)
    worker = DiLoCoWorker(
        model,
        opt,
        address,
        sync_every=cfg["sync_every"],
        worker_id=f"w{rank}",
        heartbeat_interval=1.0,
        client=client,
    )
    with worker:
        while progress[rank] < cfg["steps"]:
            x, y = sample_batch(tokens, 16, 64, gen)
            loss = loss_on(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            progress[rank] += 1
    out.put((rank, worker.sync_metrics))


def run(cfg: dict[str, Any], chaos: bool, workdir: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from diloco.demo.data import build_corpus
    from diloco.demo.model import build_model, evaluate
    from diloco.worker import DiLoCoClient

    rng = random.Random(cfg["seed"])
    model = build_model(cfg["seed"])
    init = workdir / "init.safetensors"
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(init))
    # Every life names the initial parameters: a life that finds a checkpoint in the save dir
    # resumes from it (a checkpoint wins over --init), one killed before the first checkpoint
    # starts over from them instead of waiting for a worker to upload parameters.
    server = ServerProcess(
        [
            *["--num-workers", str(cfg["workers"]), "--save-dir", str(workdir / "ckpt")],
            *["--save-every", "1", "--heartbeat-timeout", "6", "--poll-timeout", "5"],
            *["--init", str(init)],
        ],
        workdir / "server.log",
    )
    ctx = mp.get_context("spawn")
    progress = ctx.Array("i", cfg["workers"])
    out = ctx.Queue()
    procs = {
        r: ctx.Process(target=_worker, args=(r, cfg, server.address, progress, out))
        for r in range(cfg["workers"])
    }
    for p in procs.values():
        p.start()
    events = {"worker_kills": 0, "server_kills": 0}
    metrics: dict[int, list[dict[str, Any]]] = {r: [] for r in procs}

    def drain() -> None:
        """Each finished worker life's metrics, as far as they have arrived."""
        while not out.empty():
            rank, m = out.get()
            metrics[rank].append(m)

    t0 = time.monotonic()
    next_fault = t0 + rng.uniform(*cfg["fault_every"])
    try:
        while any(p.is_alive() for p in procs.values()):
            time.sleep(0.2)
            drain()
            done = min(progress[:])
            # The smoke run's first fault comes by progress, not the clock: on an idle machine
            # its few steps end before the first fault the clock would bring.
            first = cfg.get("first_fault_at") is not None and not any(events.values())
            due = time.monotonic() > next_fault or (first and done >= cfg["first_fault_at"])
            if chaos and due and done < cfg["steps"] * 0.9:
                next_fault = time.monotonic() + rng.uniform(*cfg["fault_every"])
                if rng.random() < cfg["server_share"]:
                    server.kill9()
                    events["server_kills"] += 1
                    time.sleep(rng.uniform(0.5, 3.0))
                    server.start()  # same port, resumes from its save dir
                else:
                    alive = [r for r, p in procs.items() if p.is_alive()]
                    if alive:
                        r = rng.choice(alive)
                        os.kill(procs[r].pid, signal.SIGKILL)  # type: ignore[arg-type]
                        procs[r].join()
                        events["worker_kills"] += 1
                        procs[r] = ctx.Process(
                            target=_worker, args=(r, cfg, server.address, progress, out)
                        )
                        procs[r].start()
        drain()
        client = DiLoCoClient(server.address)
        status = client.status()
        _, params = client.get_global_params()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        server.stop()
    model.load_state_dict(params, strict=False)
    eval_loss = evaluate(model, build_corpus(cfg["workers"]).eval)
    torch.set_num_threads(1)
    return {
        "chaos": chaos,
        "rounds": status["round"],
        "worker_deaths": status["worker_deaths"],
        "reconnections": sum(m["reconnections"] for ms in metrics.values() for m in ms),
        "failed_syncs": sum(m["failed_syncs"] for ms in metrics.values() for m in ms),
        "server_restarts": server.starts - 1,
        **events,
        "eval_loss": eval_loss,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="inner steps per worker slot")
    parser.add_argument("--sync-every", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fault-min", type=float, default=4.0, help="seconds between faults, low end"
    )
    parser.add_argument(
        "--fault-max", type=float, default=10.0, help="seconds between faults, high end"
    )
    parser.add_argument(
        "--server-share", type=float, default=0.4, help="share of faults that kill the server"
    )
    parser.add_argument("--json")
    smoke.add_flag(parser)
    args = parser.parse_args(argv)
    first_fault_at = None
    if args.smoke:  # 2 workers, 8 rounds each run, a fault at a quarter, then every 4-5 s
        args.workers, args.steps, args.sync_every = 2, 80, 10
        args.fault_min, args.fault_max, args.server_share = 4.0, 5.0, 0.5
        first_fault_at = args.steps // 4
    cfg = {
        "workers": args.workers,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "seed": args.seed,
        "lr": 3e-3,
        "fault_every": (args.fault_min, args.fault_max),
        "server_share": args.server_share,
        "first_fault_at": first_fault_at,
    }
    results = []
    for chaos in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            print(
                f"running {'with' if chaos else 'without'} faults ...", file=sys.stderr, flush=True
            )
            results.append(run(cfg, chaos, Path(tmp)))
    keys = [
        "rounds",
        "worker_kills",
        "server_kills",
        "worker_deaths",
        "reconnections",
        "failed_syncs",
        "eval_loss",
        "wall_s",
    ]
    print(
        f"\nchaos run: {args.workers} workers x {args.steps} steps, sync every "
        f"{args.sync_every}, seed {args.seed}"
    )
    print_table(
        ["run", *keys],
        [
            [
                "faults" if r["chaos"] else "fault-free",
                *(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys),
            ]
            for r in results
        ],
    )
    if args.json:
        write_json(args.json, results)
    if args.smoke:
        check_smoke(results, args)
    return 0


def check_smoke(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Both runs finished on their own (every worker slot trained to its last step): the
    fault-free one with every round, the other with faults injected (how many rounds survive
    them depends on where the clock put the kills); both global models evaluate to a finite
    loss."""
    calm, chaos = results
    smoke.require(calm["rounds"] == args.steps // args.sync_every, "the fault-free run's rounds")
    smoke.require(chaos["worker_kills"] + chaos["server_kills"] >= 1, "faults were injected")
    for r in results:
        smoke.require(0 < r["eval_loss"] < 10, f"a finite held-out loss ({r['eval_loss']})")
    smoke.passed("chaos")


if __name__ == "__main__":
    sys.exit(main())
