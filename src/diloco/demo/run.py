"""``diloco demo``: a server and M worker processes on 127.0.0.1 train a character model.

One more process trains the same model for the same number of steps with no DiLoCo, on all the
training text, so the report compares like with like: same steps per process, same batch. The
plot does too: the global model's held-out loss, evaluated at each round, against the single
worker's held-out loss, evaluated at the same inner steps (its training loss is no measure of
the global model's, which is never trained on directly).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path
from typing import Any

from diloco.server.config import ServerConfig

log = logging.getLogger(__name__)

SWARM_STEPS = 200
"""``--swarm``'s default steps per process: a swarm step is about ten HTTP stage calls."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DiLoCo worker processes (default 4; 2 with --swarm)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"inner steps per worker (default 1000; {SWARM_STEPS} with --swarm)",
    )
    p.add_argument(
        "--sync-every", type=int, default=50, help="inner steps per round, H (default 50)"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument(
        "--outer-lr",
        type=float,
        default=ServerConfig.outer_lr,  # the server's own default, declared once there
        help="outer SGD learning rate (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="send fp32 pseudo-gradients")
    p.add_argument("--out", default="demo_out", help="where report.json and loss.png go")
    p.add_argument(
        "--allreduce",
        action="store_true",
        help="all-reduce mode: the workers average among themselves, the server only coordinates",
    )
    p.add_argument(
        "--swarm",
        action="store_true",
        help="also train the model as a 3-stage pipeline swarm on this machine (2 head, 2 body, "
        "1 tail replicas as threads; stage sync every --sync-every) beside a 2-worker DiLoCo "
        "run and the single worker, on the same steps per process; about a minute at the "
        "defaults on a 2-core machine",
    )


# --- child processes ------------------------------------------------------------------------------


def _train(rank: int, cfg: dict[str, Any], address: str | None, events: Any) -> None:
    """A worker (``address`` set) or the baseline (``address`` None). Reports through ``events``."""
    import torch

    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, evaluate, loss_on

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    corpus = build_corpus(cfg["workers"])
    tokens = corpus.shards[rank] if address else corpus.train
    model = build_model(cfg["seed"], cfg["seq_len"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)

    eval_loss: float | None = None

    def loop(worker: Any) -> None:
        nonlocal eval_loss
        for step in range(1, cfg["steps"] + 1):
            x, y = sample_batch(tokens, cfg["batch_size"], cfg["seq_len"], gen)
            loss = loss_on(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = float(loss.detach())
            if worker is not None:
                worker.report(loss=value, samples=x.numel())
                if cfg["allreduce"] and rank == 0 and worker.local_step == 0:
                    # All-reduce mode: no server holds the global model; right after a sync the
                    # model is it, so worker 0 evaluates it.
                    held_out = evaluate(model, corpus.eval, cfg["seq_len"])
                    events.put(("global", rank, worker.base_round, held_out))
            events.put(("step", rank, step, value))
            if worker is None and (step % cfg["sync_every"] == 0 or step == cfg["steps"]):
                # The baseline's held-out loss at the steps the global model's is taken.
                eval_loss = evaluate(model, corpus.eval, cfg["seq_len"])
                events.put(("eval", rank, step, eval_loss))

    if address is None:
        loop(None)
        metrics: dict[str, Any] = {}
    else:
        from diloco.worker import DiLoCoWorker

        with DiLoCoWorker(
            model,
            opt,
            address,
            sync_every=cfg["sync_every"],
            bf16_comm=cfg["bf16"],
            worker_id=f"worker-{rank}",
            heartbeat_interval=5.0,
        ) as w:
            loop(w)
        metrics = w.sync_metrics
    # Plain numbers only: the baseline evaluates itself rather than shipping its tensors.
    events.put(("done", rank, metrics, eval_loss))


# --- parent ---------------------------------------------------------------------------------------


class _Bars:
    """One tqdm bar per process, drawn by the parent only so the terminal stays readable."""

    def __init__(self, names: list[str], total: int) -> None:
        from tqdm import tqdm

        self.bars = [
            tqdm(
                total=total,
                desc=f"{n:<9}",
                position=i,
                leave=True,
                dynamic_ncols=True,
                file=sys.stderr,
            )
            for i, n in enumerate(names)
        ]

    def step(self, i: int, loss: float) -> None:
        self.bars[i].update(1)
        if self.bars[i].n % 10 == 0:
            self.bars[i].set_postfix_str(f"loss {loss:.3f}", refresh=False)

    def close(self) -> None:
        for bar in self.bars:
            bar.close()


def settle(args: argparse.Namespace) -> str | None:
    """Fill the defaults that depend on ``--swarm`` (``--workers`` 4 or 2, ``--steps`` 1000 or
    ``SWARM_STEPS``) in ``args``; what is wrong with the flags, or None."""
    if args.workers is None:
        args.workers = 2 if args.swarm else 4
    if args.steps is None:
        args.steps = SWARM_STEPS if args.swarm else 1000
    if args.swarm and (args.workers != 2 or args.allreduce):
        return "--swarm runs beside 2 DiLoCo workers in server mode (no other --workers, no --allreduce)"
    if args.workers < 1 or args.steps < 1 or args.sync_every < 1:
        return "--workers, --steps and --sync-every must be >= 1"
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from diloco.demo.data import build_corpus
    from diloco.demo.model import build_model, evaluate
    from diloco.server import DiLoCoServer, ServerConfig

    refused = settle(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    cfg = {
        "workers": args.workers,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "bf16": not args.no_bf16,
        "allreduce": args.allreduce,
        "outer_lr": args.outer_lr,  # the swarm's coordinator's (the server here takes its own)
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("diloco").setLevel(logging.WARNING)  # the bars are the progress report
    torch.set_num_threads(1)
    corpus = build_corpus(args.workers)
    eval_model = build_model(args.seed, args.seq_len)
    init_loss = evaluate(eval_model, corpus.eval, args.seq_len)
    t0 = time.monotonic()
    config = ServerConfig(
        port=0, num_workers=args.workers, outer_lr=args.outer_lr, allreduce=args.allreduce
    )
    # Every worker builds the same model from the seed; in all-reduce mode they agree on it at
    # their first quorum, in server mode the server starts from it.
    initial = None if args.allreduce else {n: p.detach() for n, p in eval_model.named_parameters()}
    server = DiLoCoServer(config, initial_params=initial).start()
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [
        ctx.Process(target=_train, args=(r, cfg, server.address, events), daemon=True)
        for r in range(args.workers)
    ]
    procs.append(ctx.Process(target=_train, args=(args.workers, cfg, None, events), daemon=True))
    for p in procs:
        p.start()
    names = [f"worker {r}" for r in range(args.workers)] + ["baseline"]
    bars = _Bars(names, args.steps)
    curves: dict[int, list[tuple[int, float]]] = {r: [] for r in range(len(procs))}
    global_curve: list[tuple[int, float]] = [(0, init_loss)]
    baseline_curve: list[tuple[int, float]] = [(0, init_loss)]  # the same model at step 0
    finished: dict[int, Any] = {}
    baseline_loss = float("nan")
    seen_round = 0
    failed = ""
    try:
        while len(finished) < len(procs):
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in finished]
                if dead:
                    failed = f"{names[dead[0]]} exited with code {procs[dead[0]].exitcode}"
                    break
                ev = None
            if ev is not None and ev[0] == "step":
                _, rank, step, loss = ev
                bars.step(rank, loss)
                curves[rank].append((step, loss))
            elif ev is not None and ev[0] == "eval":
                baseline_curve.append((ev[2], ev[3]))
            elif ev is not None and ev[0] == "global":
                global_curve.append((ev[2] * args.sync_every, ev[3]))
            elif ev is not None and ev[0] == "done":
                finished[ev[1]] = ev[2]
                if ev[3] is not None:
                    baseline_loss = ev[3]
            rnd = server.status()["round"]
            if rnd != seen_round and not args.allreduce:  # the global model, once per round
                seen_round = rnd
                eval_model.load_state_dict(server.global_params(), strict=False)
                global_curve.append(
                    (rnd * args.sync_every, evaluate(eval_model, corpus.eval, args.seq_len))
                )
    finally:
        bars.close()
        for p in procs:
            p.join(timeout=30 if not failed else 1)
            if p.is_alive():
                p.terminate()
    if failed:
        server.stop()
        print(f"error: {failed}; see the messages above", file=sys.stderr)
        return 1
    status = server.status()
    if args.allreduce:
        global_loss = global_curve[-1][1]  # worker 0's evaluation after its last sync
    else:
        eval_model.load_state_dict(server.global_params(), strict=False)
        global_loss = evaluate(eval_model, corpus.eval, args.seq_len)
    if global_curve[-1][0] != status["round"] * args.sync_every:
        global_curve.append((status["round"] * args.sync_every, global_loss))
    server.stop()
    wall = time.monotonic() - t0  # the DiLoCo run's (and the single worker's, beside it)
    swarm = _run_swarm(args, cfg, corpus, init_loss) if args.swarm else None
    worker_metrics = [finished[r] for r in range(args.workers)]
    report = {
        "workers": args.workers,
        "steps_per_worker": args.steps,
        "sync_every": args.sync_every,
        "bf16_comm": cfg["bf16"],
        "mode": "allreduce" if args.allreduce else "server",
        "rounds": status["round"],
        "initial_eval_loss": init_loss,
        "global_eval_loss": global_loss,
        "baseline_eval_loss": baseline_loss,
        "bytes_up": sum(m["bytes_up"] for m in worker_metrics),
        "bytes_down": sum(m["bytes_down"] for m in worker_metrics),
        "collective_bytes": sum(m["collective_bytes"] for m in worker_metrics),
        "sync_time_s": [round(m["sync_time_s"], 3) for m in worker_metrics],
        "wall_time_s": round(wall, 1),
        "global_curve": global_curve,
        "baseline_curve": baseline_curve,
    }
    report |= swarm.report() if swarm is not None else {}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(
        out / "loss.png", curves, names, global_curve, baseline_curve,
        swarm.curve if swarm is not None else None,
    )  # fmt: skip
    mb = 1024 * 1024
    print(
        f"\nDiLoCo demo: {args.workers} workers x {args.steps} steps, sync every {args.sync_every} "
        f"({'bf16' if cfg['bf16'] else 'fp32'} pseudo-gradients)\n"
        f"  held-out loss (nats/byte): global model {global_loss:.3f}   single worker {baseline_loss:.3f}"
        f"   (initial {init_loss:.3f})\n"
        f"  rounds {status['round']}   sent {report['bytes_up'] / mb:.1f} MB up, {report['bytes_down'] / mb:.1f} MB down"
        f"   wall time {wall:.0f} s\n"
        f"  wrote {out / 'report.json'} and {out / 'loss.png'}"
    )
    if swarm is not None:
        print(swarm.summary())
    return 0


def _run_swarm(args: argparse.Namespace, cfg: dict[str, Any], corpus: Any, init_loss: float) -> Any:
    """The pipeline swarm (``demo.swarm``) on the DiLoCo run's 2 shards, one bar a driver."""
    from diloco.demo.swarm import run_swarm

    bars = _Bars(["swarm head 0", "swarm head 1"], args.steps)
    try:
        return run_swarm(cfg, corpus, init_loss, bars.step)
    finally:
        bars.close()


def _plot(
    path: Path,
    curves: dict[int, list[tuple[int, float]]],
    names: list[str],
    global_curve: list[tuple[int, float]],
    baseline_curve: list[tuple[int, float]],
    swarm_curve: list[tuple[int, float]] | None = None,
) -> None:
    """Left, like with like: the held-out loss of the global model and of the single worker,
    at the same inner steps (and the pipeline swarm's, with ``--swarm``). Right, for reference: each process's training loss (a worker's
    is on its own shard, the baseline's on all the text)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, train) = plt.subplots(1, 2, figsize=(12, 5))
    gs, gl = zip(*global_curve, strict=True)
    held.plot(gs, gl, "o-", color="crimson", lw=2, ms=4, label="global model (DiLoCo)")
    bs, bl = zip(*baseline_curve, strict=True)
    held.plot(bs, bl, "s-", color="black", lw=1.5, ms=3, label="single worker")
    if swarm_curve is not None:
        ss, sl = zip(*swarm_curve, strict=True)
        held.plot(ss, sl, "^-", color="royalblue", lw=1.5, ms=4, label="pipeline swarm (3 stages)")
    held.set_title("Held-out loss")
    for rank, points in curves.items():
        if not points:
            continue
        steps, losses = zip(*points, strict=True)
        is_base = names[rank] == "baseline"
        train.plot(
            steps,
            _moving_average(list(losses), 20),
            lw=1.8 if is_base else 0.9,
            color="black" if is_base else None,
            alpha=1.0 if is_base else 0.6,
            label="single worker" if is_base else names[rank],
        )
    train.set_title("Training loss (each process on its own data)")
    for ax in (held, train):
        ax.set_xlabel("inner step")
        ax.set_ylabel("cross-entropy, nats per byte")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("DiLoCo demo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _moving_average(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out
