"""Synchronous DiLoCo rounds on loopback, against the raw-socket limit of the same machine.

For a model of P fp32 parameters (a stack of square bias-free ``nn.Linear`` layers) and N workers:

* the server runs in its own spawned process, loading the initial parameters from a safetensors
  file written to a temporary directory (so no worker uploads them);
* N spawned worker processes each hold the model, an SGD optimizer and a ``DiLoCoWorker``
  (``sync_every`` huge, no heartbeats, one torch thread). Each round they perturb their
  parameters in place (standing in for local training), meet at a ``multiprocessing.Barrier``
  and time ``force_sync()``. A round's wall time runs from the earliest start after the barrier
  to the moment the last worker has adopted the new parameters (``time.monotonic``, which on
  Linux is one system-wide clock, so stamps from different processes compare). A worker that
  is done waits for the others before its checksum and next perturbation, as the raw-socket
  clients below wait: on a shared 2-core machine that work would otherwise slow the
  downloads still running;
* the loopback limit: N plain-socket client processes each send the upload size U to one server
  process, which receives every upload into a preallocated buffer and then sends the download
  size D back to each client. Same bytes, same pattern, no HTTP, no Python-level copies;
* both run side by side: after the warm-ups, each measured DiLoCo round is paired with a raw
  round right before or after it (the order alternates), so that the two see the same load on
  a shared machine, whose speed drifts over minutes. Where both sets of processes would not fit
  in memory at once (or with ``--sequential``), the raw rounds run after all DiLoCo rounds.
  Efficiency is the median raw round over the median DiLoCo round; with pairs, the median of
  the per-pair ratios is printed next to it.

Communication configurations (``--comm UP/DOWN ...``, default ``bf16/fp32``, today's rounds):
the workers' upload codec (``DiLoCoWorker(codec=UP)``: fp32, bf16, int8, int4, int4:block=32,
lowrank:8, ...) and the server's ``download_codec`` (DOWN: fp32 sends full parameters every
round; bf16, int8, int4 publish each round as a compressed update; sparse, under plain averaged
descent (``--outer-rule sparseloco``, implied), as the positions it changed with their new
values, docs/design/codecs.md "The sparse update"). For each worker count the
configurations run back to back, each on a fresh server from the same initial parameters, so
that the machine's load and drift touch them as alike as a run allows; each gets its own
raw-socket limit for the bytes it moved. The bytes reported are measured: each worker's counters around its sync and
the server's status between rounds. Beside each row, its bytes and round time against the
``bf16/fp32`` row of the same worker count, when the run has one.

CPU: each worker and raw client reads ``time.process_time()`` around its part of a round; the
parent reads the server process's user + system time (psutil) before the start barrier and once
every client has reported. On a machine whose cores are all busy during a round, the ratio of
the two CPU totals is what the wall-time efficiency follows, and it drifts less with the load.

Peak memory: ``ru_maxrss`` read inside each process at its end (exact), plus psutil polling of
RSS from the parent at ~20 Hz (can miss spikes shorter than the period). The parent never imports
torch, so the fork-before-exec copy of it that every spawned child briefly is stays small.

Code: this file is the command line, the pairing of DiLoCo and raw rounds, and the tables;
``sync_children.py`` runs inside the spawned workers, ``sync_run.py`` drives them and the
server from here, and ``benchmarks/harness/`` (sessions, the server child, the model, RSS, the
raw-socket limit, reporting) holds what every process-level benchmark shares.

Usage (from the repository root; ``./dev bench`` runs the first)::

    .venv/bin/python -m benchmarks.rounds.sync_round              # 100M params; 1, 4, 16 workers
    .venv/bin/python -m benchmarks.rounds.sync_round --params 5e6 --workers 1 2 --json out.json
    .venv/bin/python -m benchmarks.rounds.sync_round --workers 4 --comm bf16/fp32 int8/int8 int4/int8
    .venv/bin/python -m benchmarks.rounds.sync_round --smoke      # seconds: 1 worker, 2 rounds
    .venv/bin/python -m benchmarks.rounds.sync_round --workers 1 --comm int4/int4 --cprofile out/

MB below means 10**6 bytes. The targets printed next to the figures: 4 workers within 2x the
loopback limit (efficiency >= 0.5); server peak RSS <= 4.5x the fp32 model size; worker peak RSS
<= 3x, or 3.5x with a lossy upload codec (its error-feedback residual).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import psutil

from benchmarks.harness import smoke
from benchmarks.harness.loopback import LoopbackRun, estimate_loopback_bytes
from benchmarks.harness.model import ModelShape, choose_shape, write_params
from benchmarks.harness.processes import ask_child
from benchmarks.harness.report import machine_info, now, print_machine, run_head, write_json
from benchmarks.rounds.sync_children import Comm, check_comms_main, estimate_bytes, parse_comm
from benchmarks.rounds.sync_run import DiLoCoRun
from benchmarks.rounds.sync_tables import (
    BASE_COMM,
    TARGET_EFFICIENCY,
    TARGET_SERVER_X,
    TARGET_WORKER_LOSSY_X,
    TARGET_WORKER_X,
    add_ratios,
    mb,
    print_comm_table,
    print_tables,
)


def run_pair(
    ctx: Any,
    n: int,
    shape: ModelShape,
    params_path: str,
    args: argparse.Namespace,
    interleave: bool,
    comm: Comm,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """DiLoCo rounds and, unless skipped, the raw-socket limit for the bytes they moved.

    Interleaved (when memory allows both sets of processes at once): after the warm-ups, each
    measured DiLoCo round is paired with a raw round right before or after it (alternating), so
    that both see the same load on a shared machine. Otherwise all DiLoCo rounds, then all raw
    rounds."""
    with DiLoCoRun(ctx, n, shape, params_path, args, comm) as d:
        for _ in range(args.warmup):
            d.round()
        if args.skip_loopback or not interleave:
            for _ in range(args.rounds):
                d.round()
            diloco = d.finish()
            lb_result = None
        else:
            up, down = d.bytes_per_worker()  # from the warm-ups (main insists on one)
            with _loopback(ctx, n, up, down, args) as lb:
                d.settle()
                for _ in range(args.warmup):
                    lb.round()
                for r in range(args.rounds):
                    if r % 2 == 0:
                        lb.round()
                        d.round()
                    else:
                        d.round()
                        d.settle()  # the workers' next perturbation is not part of the raw round
                        lb.round()
                lb_result = lb.finish()
            diloco = d.finish()
    if lb_result is None and not args.skip_loopback:
        up, down = diloco["upload_bytes_per_worker"], diloco["download_bytes_per_worker"]
        with _loopback(ctx, n, up, down, args) as lb:
            for _ in range(args.warmup + args.rounds):
                lb.round()
            lb_result = lb.finish()
    return diloco, lb_result


def _loopback(ctx: Any, n: int, up: int, down: int, args: argparse.Namespace) -> LoopbackRun:
    return LoopbackRun(
        ctx,
        n,
        up,
        down,
        warmup=args.warmup,
        rounds=args.rounds,
        setup_timeout=args.setup_timeout,
        round_timeout=args.round_timeout,
        verbose=args.verbose,
    )


def _check_comms(ctx: Any, comms: list[Comm], timeout: float) -> list[str]:
    """What this checkout's worker or server would refuse of ``comms`` (checked in a child: the
    parent never imports torch or diloco)."""
    errors: list[str] = ask_child(
        ctx, check_comms_main, (comms,), timeout, "checking the --comm configurations"
    )
    return errors


def check_smoke(results: list[dict[str, Any]], workers: list[int]) -> None:
    """A smoke run's figures: every worker count ran, every round was consistent (one round per
    sync, N contributions, equal checksums), bytes moved and the raw limit was measured."""
    smoke.require({r["diloco"]["workers"] for r in results} == set(workers), "every N ran")
    for res in results:
        d, lb = res["diloco"], res["loopback"]
        smoke.require(d["all_rounds_ok"], f"N={d['workers']}: every round consistent")
        smoke.require(d["upload_bytes_per_worker"] > 0, "bytes went up")
        smoke.require(d["download_bytes_per_worker"] > 0, "bytes came down")
        smoke.require(d["round_s"]["median"] > 0, "rounds took time")
        smoke.require(d["server"]["maxrss"] > d["server"]["base_rss"] > 0, "server RSS read")
        smoke.require(lb is not None and lb["round_s"]["median"] > 0, "the raw limit ran")
    smoke.passed("sync_round")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    ap.add_argument(
        "--no-bf16",
        action="store_true",
        help="upload fp32 pseudo-gradients (the default --comm becomes fp32/fp32)",
    )
    ap.add_argument(
        "--comm",
        metavar="UP/DOWN",
        nargs="+",
        help="communication configurations, each measured on a fresh server for every worker "
        "count: the workers' upload codec (fp32, bf16, int8, int4, int4:block=32, lowrank:8, ...) "
        "/ the server's download codec (fp32, bf16, int8, int4, sparse); e.g. --comm bf16/fp32 "
        "int8/int8 topk/sparse (default: bf16/fp32, today's rounds)",
    )
    ap.add_argument(
        "--outer-rule",
        choices=("sgd", "sparseloco"),
        help="the server's outer rule for every configuration (default: the server's, sgd; "
        "sparseloco where the download codec is sparse, which needs it)",
    )
    ap.add_argument("--max-dim", type=int, default=2048, help="widest square layer (default 2048)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--setup-timeout", type=float, default=180.0, help="seconds (+15 per worker)")
    ap.add_argument("--round-timeout", type=float, default=600.0, help="seconds per round")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--skip-loopback", action="store_true", help="do not measure the raw limit")
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="measure the raw limit after all DiLoCo rounds instead of beside each one",
    )
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round")
    ap.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="the server writes a checkpoint every N rounds into a temporary dir (0: none)",
    )
    ap.add_argument(
        "--server-src",
        metavar="DIR",
        help="run the server from this src/ dir (another checkout's code, for an A/B)",
    )
    ap.add_argument(
        "--server-env",
        metavar="KEY=VALUE",
        action="append",
        help="environment of the server process only, e.g. MALLOC_MMAP_THRESHOLD_=131072",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="record the server and worker 0 with py-spy during the measured rounds",
    )
    ap.add_argument(
        "--cprofile",
        metavar="DIR",
        help="cProfile worker 0's force_sync in each measured round (DIR/worker0-roundR.prof; "
        "the sync thread only: what the worker's own CPU goes to)",
    )
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.cprofile:
        os.makedirs(args.cprofile, exist_ok=True)
    if args.smoke:  # a 100k-parameter model, one worker, one warm-up and one measured round
        args.params, args.workers, args.rounds, args.warmup = 1e5, [1], 1, 1
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    if args.comm and args.no_bf16:
        ap.error("--no-bf16 picks the default --comm (fp32/fp32): name fp32 uploads in --comm")
    try:
        comms = list(
            dict.fromkeys(
                parse_comm(c) for c in (args.comm or ["fp32/fp32" if args.no_bf16 else BASE_COMM])
            )
        )
    except ValueError as exc:
        ap.error(str(exc))
    multi = len(comms) > 1

    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    info = machine_info()
    print(
        f"model: {shape.describe()}; "
        f"comm (upload/download codec) {', '.join(c.label for c in comms)}; "
        f"rounds {args.warmup} warm-up + {args.rounds} measured",
        flush=True,
    )
    print_machine(info)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="diloco-bench-")
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        errors = _check_comms(ctx, comms, args.setup_timeout)
        if errors:
            ap.error("--comm: " + "; ".join(errors))
        params_path = write_params(ctx, tmp, shape, args.setup_timeout)
        for n in sorted(set(args.workers)):
            need = max(estimate_bytes(n, model_bytes, c) for c in comms)
            avail = psutil.virtual_memory().available
            if need > avail - 2**30 and not args.force:
                msg = (
                    f"N={n}: skipped, needs about {need / 2**30:.1f} GiB, "
                    f"{avail / 2**30:.1f} GiB available (use a smaller --params, or --force)"
                )
                print(msg, flush=True)
                skipped.append({"workers": n, "reason": msg})
                continue
            # Both sets of processes at once, if they fit: then each measured DiLoCo round has
            # a raw round beside it, under the same load (see run_pair).
            interleave = (
                not args.sequential
                and args.warmup >= 1
                and need + estimate_loopback_bytes(n, model_bytes) <= avail - 2**30
            )
            what = "DiLoCo rounds" + ("" if args.skip_loopback else " and loopback limit")
            how = ", interleaved" if interleave and not args.skip_loopback else ""
            # The configurations back to back, each on a fresh server: side by side in time,
            # so that the machine's load and its drift over a run touch them as alike as they can.
            for comm in comms:
                tag = f"N={n} {comm.label}" if multi else f"N={n}"
                print(f"{tag}: {what}{how} ...", flush=True)
                t = time.monotonic()
                d, lb = run_pair(ctx, n, shape, params_path, args, interleave, comm)
                print(
                    f"{tag}: round median {d['round_s']['median']:.3f} s "
                    f"(phases {d['phases_median']}; CPU s {d['cpu_s_median']}); per worker "
                    f"{mb(d['upload_bytes_per_worker'])} MB up, "
                    f"{mb(d['download_bytes_per_worker'])} MB down; "
                    f"{d['update_downloads']}/{d['worker_syncs']} syncs downloaded an update; "
                    f"took {time.monotonic() - t:.0f} s",
                    flush=True,
                )
                if lb is not None:
                    lb["interleaved"] = interleave
                    print(
                        f"{tag}: loopback median {lb['round_s']['median']:.3f} s "
                        f"(CPU s {lb['cpu_s_median']})",
                        flush=True,
                    )
                results.append({"comm": comm.label, "diloco": d, "loopback": lb})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    add_ratios(results)
    print()
    complete = [r for r in results if r["loopback"] is not None]
    if complete:
        print_tables(complete, model_bytes, multi)
    if results and (multi or not complete):
        print(
            "\nCommunication (per round, medians of the measured rounds; bytes measured: one "
            "worker's counters around its sync, the server's status):"
        )
        print_comm_table(results, model_bytes)
    if args.json:
        doc = {
            **run_head("sync_round", now(), info),
            "model": {**shape.record(), "fp32_bytes": model_bytes},
            "bf16_uploads": all(c.up == "bf16" for c in comms),
            "comm": [c.label for c in comms],
            "comm_base": BASE_COMM,
            "warmup_rounds": args.warmup,
            "measured_rounds": args.rounds,
            "targets": {
                "efficiency_at_4": TARGET_EFFICIENCY,
                "server_peak_x": TARGET_SERVER_X,
                "worker_peak_x": TARGET_WORKER_X,
                "worker_peak_lossy_x": TARGET_WORKER_LOSSY_X,
            },
            "results": results,
            "skipped": skipped,
        }
        write_json(args.json, doc)
    if args.smoke:
        check_smoke(results, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
