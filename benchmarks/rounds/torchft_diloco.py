"""torchft's DiLoCo beside this project's all-reduce mode (issue 19), in one run, on loopback.

torchft (``pip install torchft==0.2.0``; a benchmark-only extra, not in requirements-lock.txt)
runs DiLoCo as ``torchft.local_sgd.DiLoCo`` over a ``torchft.manager.Manager`` per replica, a
``torchft.coordination.LighthouseServer`` that forms quorums, and a reconfigurable
``torchft.process_group.ProcessGroupGloo``. Here each replica is one spawned process (a replica
group of world size 1 with its own ``TCPStore``), the lighthouse another; the model is the
sync-round benchmark's (``harness.model.build_model``, seed 0 everywhere, so
``init_sync=False``: no checkpoint transfer at the start); inner optimizer SGD, outer SGD
(lr 0.7, momentum 0.9, Nesterov) as this project's defaults; ``sync_every=1``, so that every
``optimizer.step()`` is one sync (its SGD part is a no-op: no gradients).

A round is measured as allreduce_round measures ours: each replica perturbs its weights
(outside the round), all meet at a barrier with the parent, each times ``optimizer.step()``
(torchft's sync: the quorum, the pseudo-gradients, one gloo all-reduce per parameter in fp32,
``should_commit``, the outer step), and the round is the latest end minus the earliest start.
The same run then measures our all-reduce mode (``allreduce_run.ConfigRun``, fp32 as torchft
sends, and bf16, today's default) on the same model and worker counts. Peak RSS: ``ru_maxrss``
of each replica at its end, against the fp32 model size and above the RSS after importing torch.

``--kill``: a replica killed with SIGKILL inside the all-reduce, torchft and ours. torchft's
victim wraps its process group's ``allreduce`` to say so and block at round ``--kill-round``;
the survivors say when they issued theirs; the parent kills the victim once all did. For each
survivor: seconds from the kill until its next committed sync (how long it was blocked), for
each lighthouse join timeout in ``--torchft-join-timeouts`` (default 10 s, and 60 s: the
``torchft_lighthouse`` binary's default; the Python ``LighthouseServer`` defaults to 100 ms, with
which quorums form without a replica that asks a moment late), with min_replicas N-1 and the
lighthouse's default heartbeat timeout (5 s). Ours: the
same through allreduce_round's kill run (``ServerConfig(heartbeat_timeout=5)``).

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.rounds.torchft_diloco --params 5e6 --workers 2 4 --kill
    .venv/bin/python -m benchmarks.rounds.torchft_diloco --params 100e6 --workers 2 4 --kill \\
        --json benchmarks/results/torchft_diloco_100M.json
    .venv/bin/python -m benchmarks.rounds.torchft_diloco --smoke  # without torchft: ours only
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import sys
import time
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.model import choose_shape
from benchmarks.harness.report import (
    above_base,
    fmt_mb,
    machine_info,
    now,
    ok,
    print_machine,
    print_table,
    run_head,
    seconds,
    spread,
    times_model,
    write_json,
)
from benchmarks.harness.rss import skipped_for_memory
from benchmarks.harness.source import use_src
from benchmarks.rounds import allreduce_round, allreduce_run
from benchmarks.rounds.torchft_run import run_torchft, run_torchft_kill

# --- report ----------------------------------------------------------------------------------


def print_tables(results: list[dict[str, Any]], model_bytes: int) -> None:
    print_table(
        [
            "N",
            "config",
            "sync s median (min-max)",
            "worker peak RSS MB (x model)",
            "worker peak above torch base (x model)",
            "rounds ok",
        ],
        [
            [
                str(d["workers"]),
                d["config"],
                spread(d["round_s"]),
                times_model(d["worker"]["maxrss"], model_bytes),
                above_base(d["worker"], model_bytes),
                ok(d["all_rounds_ok"]),
            ]
            for d in results
        ],
    )
    for d in results:
        if d["phases_median"]:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in d["phases_median"].items())
            print(f"- N={d['workers']} {d['config']}: {parts}")


def print_torchft_kill(res: dict[str, Any]) -> None:
    jt = res["join_timeout_s"]
    print(
        f"\ntorchft: replica killed inside the all-reduce ({res['workers']} replicas, "
        f"{res['params']:,} params; lighthouse min_replicas {res['workers'] - 1}, join timeout "
        f"{'LighthouseServer default (0.1 s)' if jt is None else f'{jt:g} s'}, heartbeat timeout "
        "default (5 s); "
        f"Manager and ProcessGroupGloo timeout {res['timeout_s']:g} s, quorum timeout "
        f"{res['quorum_timeout_s']:g} s); seconds after the SIGKILL:"
    )
    print_table(
        [
            "survivor",
            "raised (s after kill: error)",
            "interrupted sync returned (committed?, quorum size)",
            "next quorum",
            "next committed sync ended (blocked)",
            "later syncs s",
        ],
        [
            [
                str(s["worker"]),
                "-"
                if s["raised"] is None
                else f"{s['raised']['s_after_kill']:.2f}: {s['raised']['error'][:80]}",
                f"{seconds(s['failed_sync_ended_s'])} ({s['failed_sync_committed']}, "
                f"{s['failed_sync_participants']})",
                seconds(s["next_quorum_s"]),
                seconds(s["blocked_s"]),
                ", ".join(f"{x:.2f}" for x in s["later_syncs_s"]) or "-",
            ]
            for s in res["survivors"]
        ],
    )
    if res["not_inside"]:
        print("not all inside the all-reduce: " + "; ".join(res["not_inside"]))


def print_kill_summary(kills: list[dict[str, Any]], our_kill: list[dict[str, Any]]) -> None:
    """One line per kill run: each survivor's seconds from the SIGKILL to its next completed
    (committed) sync, and what raised."""
    rows = []
    for k in kills:
        jt = k["join_timeout_s"]
        rows.append(
            [
                "torchft",
                f"join timeout {'0.1 (default)' if jt is None else f'{jt:g}'} s, "
                f"timeout {k['timeout_s']:g} s, quorum timeout {k['quorum_timeout_s']:g} s",
                ", ".join(
                    "-" if s["blocked_s"] is None else f"{s['blocked_s']:.2f}"
                    for s in k["survivors"]
                ),
                "; ".join(
                    f"survivor {s['worker']} at {s['raised']['s_after_kill']:.1f} s: "
                    f"{s['raised']['error'][:60]}"
                    for s in k["survivors"]
                    if s["raised"]
                )
                or "-",
            ]
        )
    for k in our_kill:
        rows.append(
            [
                "ours",
                f"heartbeat timeout {k['heartbeat_timeout_s']:g} s, collective timeout "
                f"{k['collective_timeout_s']:g} s",
                ", ".join(
                    "-" if s.get("blocked_s") is None else f"{s['blocked_s']:.2f}"
                    for s in k["survivors"]
                ),
                "-",
            ]
        )
    print("\nKill runs: each survivor's seconds from the SIGKILL to its next completed sync:")
    print_table(["system", "settings", "blocked s (each survivor)", "raised"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    allreduce_run.add_args(ap)
    ap.set_defaults(workers=[2, 4])
    ap.add_argument(
        "--torchft-timeout",
        type=float,
        default=30.0,
        help="torchft Manager and ProcessGroupGloo timeouts, s (default 30, as our "
        "collective_timeout)",
    )
    ap.add_argument(
        "--torchft-quorum-timeout",
        type=float,
        default=120.0,
        help="torchft Manager quorum_timeout, s (default 120: longer than the 60 s join "
        "timeout, so that a survivor waiting for a quorum is measured, not cut "
        "short by its own timeout; torchft's default is 60)",
    )
    ap.add_argument(
        "--torchft-join-timeouts",
        type=float,
        nargs="+",
        default=[10.0, 60.0],
        help="lighthouse join timeouts of the kill runs, s (default 10 and 60, the "
        "torchft_lighthouse binary's default; 0: LighthouseServer's own default, 100 ms)",
    )
    ap.add_argument("--no-ours", action="store_true", help="torchft only")
    ap.add_argument("--no-torchft", action="store_true", help="ours only")
    ap.add_argument("--kill-only", action="store_true", help="only the kill runs (needs --kill)")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    have_torchft = importlib.util.find_spec("torchft") is not None
    if args.smoke:  # N=2, one measured round, torchft beside our fp32; kills only with torchft
        args.params, args.workers, args.rounds, args.warmup = 1e5, [2], 1, 1
        if have_torchft:
            args.kill, args.kill_workers, args.kill_round, args.kill_after = True, 2, 1, 1
            args.kill_repeats, args.torchft_join_timeouts = 1, [0.0]
        else:
            smoke.skip("torchft's side", "torchft is not installed (pip install torchft==0.2.0)")
            args.no_torchft = True
    elif not have_torchft and not args.no_torchft:
        ap.error("torchft is not installed (pip install torchft==0.2.0), or run --no-torchft")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    code = use_src(args.src)
    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    info = machine_info()
    started = now()
    from importlib.metadata import version  # the parent never imports torch

    versions = {k: version(k) for k in ("torchft", "torch") if k != "torchft" or have_torchft}
    print(
        f"{started}; model: {shape.describe()}; rounds {args.warmup} warm-up "
        f"+ {args.rounds} measured; {versions}",
        flush=True,
    )
    print_machine(info)
    print(f"code: {code}", flush=True)
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in [] if args.kill_only else sorted(set(args.workers)):
        runs: list[tuple[str, Any]] = [] if args.no_torchft else [("torchft fp32", None)]
        if not args.no_ours:
            runs += [
                ("ours", allreduce_run.Config("allreduce", False, proxied=False)),
                ("ours", allreduce_run.Config("allreduce", True, proxied=False)),
            ]
        if args.smoke:
            runs = [(label, cfg) for label, cfg in runs if cfg is None or not cfg.bf16]
        for label, cfg in runs:
            need = (
                int(n * (8.5 * model_bytes + allreduce_run.OVERHEAD))
                if cfg is None
                else allreduce_run.estimate_bytes(n, model_bytes, cfg)
            )
            tag = f"N={n} {label if cfg is None else cfg.label}"
            if skipped_for_memory(need, tag, args.force, skipped):
                continue
            print(f"{tag} ...", flush=True)
            t = time.monotonic()
            if cfg is None:
                d = run_torchft(ctx, n, shape, args)
            else:
                d = allreduce_round.run_config(ctx, cfg, n, shape, "", args)
                d["config"] = "ours " + d["config"]
            print(
                f"{tag}: sync median {d['round_s']['median']:.3f} s; phases "
                f"{d['phases_median']}; worker peak {fmt_mb(d['worker']['maxrss'])} MB; "
                f"took {time.monotonic() - t:.0f} s",
                flush=True,
            )
            results.append(d)
    kills: list[dict[str, Any]] = []
    our_kill: list[dict[str, Any]] | None = None
    if args.kill:
        kshape = choose_shape(args.kill_params or args.params, args.max_dim)
        for jt in [] if args.no_torchft else args.torchft_join_timeouts:
            join = None if jt <= 0 else jt
            for i in range(args.kill_repeats):
                print(
                    f"torchft kill run {i + 1}/{args.kill_repeats}, join timeout "
                    f"{join or 'default'} ...",
                    flush=True,
                )
                kills.append(run_torchft_kill(ctx, kshape, args, join))
        if not args.no_ours:
            our_kill = []
            for i in range(args.kill_repeats):
                print(f"our kill run {i + 1}/{args.kill_repeats} ...", flush=True)
                our_kill.append(allreduce_round.run_kill(ctx, kshape, args))
    print()
    if results:
        print_tables(results, model_bytes)
        print(f"\nModel = {fmt_mb(model_bytes)} MB fp32; MB = 10**6 B.")
    for k in kills:
        print_torchft_kill(k)
    for k in our_kill or []:
        allreduce_round.print_kill(k)
    if kills or our_kill:
        print_kill_summary(kills, our_kill or [])
    if args.json:
        write_json(
            args.json,
            {
                **run_head("torchft_diloco", started, info),
                "code": code,
                "versions": versions,
                "model": shape.record(),
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "results": results,
                "torchft_kill": kills,
                "our_kill": our_kill,
                "skipped": skipped,
            },
        )
    if args.smoke:
        check_smoke(results, kills, our_kill or [], have_torchft)
    return 0


def check_smoke(
    results: list[dict[str, Any]],
    kills: list[dict[str, Any]],
    our_kill: list[dict[str, Any]],
    have_torchft: bool,
) -> None:
    """Every configuration (ours, and torchft's where installed) ran consistent rounds, and
    after a kill every survivor synced again."""
    configs = {d["config"] for d in results}
    smoke.require("ours allreduce fp32 (direct)" in configs, f"our side ran (got {configs})")
    smoke.require(not have_torchft or "torchft fp32" in configs, "torchft's side ran")
    for d in results:
        smoke.require(d["all_rounds_ok"], f"{d['config']}: every round consistent")
    for k in kills + our_kill:
        for s in k["survivors"]:
            smoke.require(s.get("blocked_s") is not None, f"survivor {s['worker']} went on")
    smoke.passed("torchft_diloco")


if __name__ == "__main__":
    sys.exit(main())
