"""Compute utilization: the fraction of wall time a worker spends training when it syncs over a
slow link, for blocking DiLoCo and for streaming DiLoCo with overlap, with and without codecs.

Each worker runs a training loop of fixed-length steps: ``optimizer.step()`` on fixed fake
gradients (set once) followed by ``time.sleep(--step-time)``, the stand-in for the GPU's forward
and backward. Every ``--sync-every`` steps is one round. Each worker reaches the server through a
shaping proxy (``slow_links.Links``: token buckets of RATE MB/s per worker and direction). The
server and the workers run in this process (threads: the sleep and torch's kernels release the
GIL).

Two utilizations over ``--rounds`` rounds after a warm-up round, per worker, both printed with
their definitions:

* lenient (``utilization``): training time / wall time, where training time is the time in the
  sleep plus the time in ``optimizer.step()`` itself inside the loop (timed by an optimizer
  pre-hook and a post-hook registered before the worker's, so the sync the worker runs in its own
  post-hook is excluded). A step that the sync's CPU work (a background encode) slows counts as
  training, slowed;
* strict (``strict``): steps x step time / wall, where the step time is that of a training step
  alone (``optimizer.step()`` and the sleep, no worker attached), the mean of
  ``CALIBRATION_STEPS`` steps each worker times on a copy of its model before its worker starts,
  once every worker is set up, the workers calibrating at once as they then train at once.
  Whatever the sync adds to a step counts as idle.

Everything else (a blocking sync; a streaming worker's copy of a fragment, its merge and any
stall waiting for an exchange still out) is time the GPU would stand idle. ``gpu`` in the JSON is
steps x ``--step-time`` / wall (the sleep alone).

Configurations (``--configs``) are ``MODE:UP/DOWN``: MODE ``block`` (plain DiLoCo, the sync blocks
the step that ends a round) or ``stream`` (``--fragments`` fragments, one exchange in flight,
overlapped with ``--overlap`` steps of training, tau; by default the smallest spacing between two
fragments' sync steps, the largest tau that never makes the next fragment wait for the previous
one); UP the workers' upload codec; DOWN the server's ``download_codec`` (lossy downloads are for
plain DiLoCo only: streaming downloads its fragments in fp32; ``sparse`` implies the server's
``outer_rule="sparseloco"``, which it needs). UP may carry options, as in
``stream:topk:density=0.0156,chunk=4096,bits=2/fp32``. MB up and down per round are the bytes of
the syncs (exchanges) that ended in the measured rounds, per worker.

Streaming hides the link only while a round's exchanges fit into a round of training: it needs
(MB up + 4 x params / 1e6 MB down) / rate below the round's compute time (fp32 downloads, one
exchange in flight). At 25M parameters and 5 s rounds that holds at 50 and 100 MB/s but not at
12.5 MB/s (100 MB down alone take 8 s); there, longer rounds (``--sync-every 200``) restore it.

    .venv/bin/python -m benchmarks.training.compute_utilization --params 25e6 --workers 2 \\
        --sync-every 50 --step-time 0.1 --rates 100 50 --rounds 4
    .venv/bin/python -m benchmarks.training.compute_utilization --rates 50 12.5 --configs \
        stream:int4/fp32 stream:topk:density=0.0156,chunk=4096,bits=2/fp32
    .venv/bin/python -m benchmarks.training.compute_utilization --smoke

MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.model import build_model, width_shape
from benchmarks.harness.report import write_json
from benchmarks.harness.shaped_links import MB, Links
from benchmarks.training.utilization_figures import report, step_alone

DEFAULT_CONFIGS = [
    "block:bf16/fp32",
    "block:int8/int8",
    "block:int4/int8",
    "stream:int8/fp32",
    "stream:int4/fp32",
    "stream:topk:density=0.0156,chunk=4096,bits=2/fp32",
]


@dataclass(frozen=True)
class Config:
    spec: str
    streaming: bool
    up: str
    down: str


def parse_config(spec: str) -> Config:
    mode, _, codecs = spec.partition(":")
    up, _, down = codecs.partition("/")
    if mode not in ("block", "stream") or not up or not down:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected block:UP/DOWN or stream:UP/DOWN")
    if mode == "stream" and down != "fp32":
        raise argparse.ArgumentTypeError(f"{spec!r}: streaming downloads fp32 fragments")
    return Config(spec, mode == "stream", up, down)


def overlap_for(args: argparse.Namespace) -> int:
    """Tau: the given one, or the smallest spacing between two fragments' sync steps (a larger
    tau would make the next fragment wait for the previous one's result anyway)."""
    if args.overlap is not None:
        return args.overlap
    from diloco.core.fragments import sync_offsets

    offsets = [0, *sync_offsets(args.sync_every, args.fragments)]
    return max(1, min(b - a for a, b in zip(offsets, offsets[1:], strict=False)))


def run_config(cfg: Config, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh server and ``args.workers`` workers behind fresh links; per-worker figures over
    the measured rounds."""
    import torch

    from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig

    n, period = args.workers, args.sync_every
    streaming = {"num_fragments": args.fragments, "fragment_pattern": args.pattern}
    initial = {
        name: p.detach().clone()
        for name, p in build_model(width_shape(args.params)).named_parameters()
    }
    server = DiLoCoServer(
        ServerConfig(
            port=0,
            num_workers=n,
            upload_slots=args.slots or n,
            download_codec=cfg.down,
            heartbeat_timeout=0,
            stuck_timeout=0,
            **(streaming if cfg.streaming else {}),
            # The sparse update needs plain averaged descent (ServerConfig refuses it otherwise).
            outer_rule="sparseloco" if cfg.down == "sparse" else "sgd",
        ),
        initial_params=initial,
    ).start()
    del initial
    links = Links(n, rate)
    links.point_at(server.port)
    start = threading.Barrier(n)
    errors: list[BaseException] = []
    # Per worker, at the end of each round: (time, training and sleep seconds so far, metrics).
    marks: list[list[tuple[float, float, float, dict[str, float]]]] = [[] for _ in range(n)]
    alone = [0.0] * n  # per worker: the step time of a step alone, s (the strict figure)

    def worker(i: int) -> None:
        try:
            model = build_model(width_shape(args.params))
            gen = torch.Generator().manual_seed(100 + i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            # All set up first: a worker still building its model (randn of every parameter)
            # would slow the others' steps alone and inflate the strict figure.
            start.wait(600)
            alone[i] = step_alone(model, args.step_time)
            began = [0.0]
            trained = [0.0]  # seconds in optimizer.step() alone and in the sleep
            slept = [0.0]

            def pre(*_: Any) -> None:
                began[0] = time.perf_counter()

            def post(*_: Any) -> None:
                trained[0] += time.perf_counter() - began[0]

            # Registered before the worker's hook, so they time the step alone, not the sync.
            opt.register_step_pre_hook(pre)
            opt.register_step_post_hook(post)
            extra: dict[str, Any] = {}
            if cfg.streaming:
                extra = {**streaming, "overlap_steps": overlap_for(args), "merge_alpha": 0.5}
            w = DiLoCoWorker(
                model,
                opt,
                f"127.0.0.1:{links.ports[i]}",
                sync_every=period,
                codec=cfg.up,
                worker_id=f"util-{i}",
                heartbeat_interval=0,
                **extra,
            )
            w.start()
            # Bytes of the syncs (fragment exchanges) that ended, read on this thread after each
            # step: the client's counters also count an exchange still under way in the
            # background, so over a window they can hold one fragment more or less.
            ended, moved_up, moved_down = 0.0, 0.0, 0.0
            try:
                start.wait(600)
                for step in range(1, (args.rounds + 1) * period + 1):  # the first is a warm-up
                    opt.step()
                    t0 = time.perf_counter()
                    time.sleep(args.step_time)
                    t1 = time.perf_counter()
                    trained[0] += t1 - t0
                    slept[0] += t1 - t0
                    m = w.sync_metrics
                    now = sum(m[k] for k in ("rounds", "rebases", "refused_submissions"))
                    if now + m["failed_syncs"] != ended:
                        ended = now + m["failed_syncs"]
                        moved_up += m["last_bytes_up"]
                        moved_down += m["last_bytes_down"]
                    if step % period == 0:
                        m.update(moved_up=moved_up, moved_down=moved_down)
                        marks[i].append((t1, trained[0], slept[0], m))
                start.wait(600)  # nobody leaves (and deregisters) before the last round ends
            finally:
                w.stop(submit=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        links.close()
        server.stop(timeout=10)
    if errors:
        raise RuntimeError(f"{cfg.spec} at {rate:g} MB/s: a worker failed: {errors[0]!r}")

    per_worker = []
    for i in range(n):
        (t0, tr0, sl0, m0), (t1, tr1, sl1, m1) = marks[i][0], marks[i][-1]
        wall = t1 - t0
        steps = args.rounds * period

        def delta(key: str, m0: dict[str, float] = m0, m1: dict[str, float] = m1) -> float:
            return m1[key] - m0[key]

        per_worker.append(
            {
                "utilization": (tr1 - tr0) / wall,
                "strict": steps * alone[i] / wall,
                "step_alone_ms": 1e3 * alone[i],
                "step_in_loop_ms": 1e3 * (tr1 - tr0) / steps,
                "gpu": steps * args.step_time / wall,
                "optimizer_step_ms": 1e3 * ((tr1 - tr0) - (sl1 - sl0)) / steps,
                "sleep_overshoot_ms": 1e3 * ((sl1 - sl0) / steps - args.step_time),
                "wall_s": wall,
                "round_s": [b[0] - a[0] for a, b in zip(marks[i], marks[i][1:], strict=False)],
                "mb_up_per_round": delta("moved_up") / MB / args.rounds,
                "mb_down_per_round": delta("moved_down") / MB / args.rounds,
                "client_mb_up_per_round": delta("bytes_up") / MB / args.rounds,
                "client_mb_down_per_round": delta("bytes_down") / MB / args.rounds,
                **{
                    k: delta(k)
                    for k in (
                        "rounds",
                        "sync_time_s",
                        "stall_time_s",
                        "barrier_wait_s",
                        "stalls",
                        "fragments_sent",
                        "failed_syncs",
                        "retries",
                        "reconnections",
                        "rebases",
                        "refused_submissions",
                        "update_downloads",
                        "full_downloads",
                    )
                },
            }
        )
    rounds = [statistics.median(x) for x in zip(*(w["round_s"] for w in per_worker), strict=True)]
    return {
        "config": cfg.spec,
        "rate_mb_s": rate,
        "utilization": statistics.mean(w["utilization"] for w in per_worker),
        "utilization_min": min(w["utilization"] for w in per_worker),
        "strict": statistics.mean(w["strict"] for w in per_worker),
        "strict_min": min(w["strict"] for w in per_worker),
        "step_alone_ms": statistics.mean(w["step_alone_ms"] for w in per_worker),
        "step_in_loop_ms": statistics.mean(w["step_in_loop_ms"] for w in per_worker),
        "gpu": statistics.mean(w["gpu"] for w in per_worker),
        "round_s": statistics.median(rounds),
        "compute_round_s": period * args.step_time,
        "mb_up_per_round": statistics.mean(w["mb_up_per_round"] for w in per_worker),
        "mb_down_per_round": statistics.mean(w["mb_down_per_round"] for w in per_worker),
        "sync_s_per_round": statistics.mean(w["sync_time_s"] for w in per_worker) / args.rounds,
        "stall_s_per_round": statistics.mean(w["stall_time_s"] for w in per_worker) / args.rounds,
        "optimizer_step_ms": statistics.mean(w["optimizer_step_ms"] for w in per_worker),
        "workers": per_worker,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (default 25e6)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=50, help="inner steps per round")
    ap.add_argument("--step-time", type=float, default=0.1, help="seconds each step sleeps")
    ap.add_argument(
        "--rates", type=float, nargs="+", default=[100.0, 50.0], help="MB/s per worker, direction"
    )
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds after one warm-up")
    ap.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        default=[parse_config(c) for c in DEFAULT_CONFIGS],
    )
    ap.add_argument("--fragments", type=int, default=4, help="streaming: fragments (P)")
    ap.add_argument("--pattern", default="strided", choices=("sequential", "strided"))
    ap.add_argument("--overlap", type=int, help="streaming: tau, steps (default: max useful)")
    ap.add_argument("--slots", type=int, help="server upload slots (default: --workers)")
    ap.add_argument("--target", type=float, default=0.95, help="utilization to reach")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--log-level", default="WARNING", help="of the server's and workers' logs")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # 1M parameters, rounds of 8 x 10 ms steps, blocking and streaming
        args.params, args.workers, args.sync_every, args.step_time = 1e6, 2, 8, 0.01
        args.rates, args.rounds, args.fragments = [100.0], 1, 2
        specs = ("block:bf16/fp32", "stream:int8/fp32", "stream:topk/fp32", "block:topk/sparse")
        args.configs = [parse_config(c) for c in specs]
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("diloco").setLevel(args.log_level.upper())

    import torch

    torch.set_num_threads(1)
    model_params = sum(p.numel() for p in build_model(width_shape(args.params)).parameters())
    print(
        f"{args.workers} workers, {model_params / 1e6:.1f}M parameters, {args.sync_every} steps of "
        f"{args.step_time:g} s per round ({args.sync_every * args.step_time:g} s of compute); "
        f"streaming: {args.fragments} fragments ({args.pattern}), tau {overlap_for(args)} steps",
        flush=True,
    )
    results = []
    for rate in args.rates:
        for cfg in args.configs:
            r = run_config(cfg, rate, args)
            results.append(r)
            print(
                f"  {rate:g} MB/s {cfg.spec:<17} utilization lenient {r['utilization']:6.1%} "
                f"(min {r['utilization_min']:.1%}), strict {r['strict']:6.1%} (min "
                f"{r['strict_min']:.1%}; step alone {r['step_alone_ms']:.0f} ms, in the loop "
                f"{r['step_in_loop_ms']:.0f} ms); round {r['round_s']:.2f} s; up "
                f"{r['mb_up_per_round']:.1f} MB, down {r['mb_down_per_round']:.1f} MB per worker "
                f"and round; in the sync hook {r['sync_s_per_round']:.2f} s per round (waiting "
                f"{r['stall_s_per_round']:.2f} s); optimizer step {r['optimizer_step_ms']:.0f} ms",
                flush=True,
            )
    print()
    report(results, args.rates, reference=DEFAULT_CONFIGS[0], target=args.target)
    if args.json:
        out = {"args": {**vars(args), "configs": [c.spec for c in args.configs]}}
        write_json(args.json, {**out, "model_params": model_params, "results": results})
    if args.smoke:
        smoke.require(len(results) == len(args.configs), "every configuration ran")
        for r in results:
            smoke.require(0 < r["utilization"] <= 1.0, f"{r['config']}: a utilization")
            # The step alone is timed once, before the run: a load spike then (a shared machine)
            # can lift the strict figure a little past 1; far past it would be a miscount.
            smoke.require(0 < r["strict"] <= 1.25, f"{r['config']}: a strict utilization")
            smoke.require(r["round_s"] > 0 and r["mb_up_per_round"] > 0, "rounds moved bytes")
        smoke.passed("compute_utilization")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
