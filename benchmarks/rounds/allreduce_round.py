"""Server mode against all-reduce mode (issue 19) on loopback, side by side in one run.

For a model of P fp32 parameters (the sync-round benchmark's stack of square bias-free
``nn.Linear`` layers, ``harness.model.choose_shape``) and each worker count N, these
configurations run back to back, each on a fresh server and fresh worker processes:

* ``server bf16``: ``DiLoCoServer(ServerConfig(num_workers=N))`` holding the parameters (loaded
  from a safetensors file, so that no worker uploads them), workers with ``bf16_comm=True``
  (today's default: bf16 pseudo-gradients up, fp32 parameters down);
* ``allreduce bf16``: ``ServerConfig(num_workers=N, allreduce=True)``, the same workers with
  ``bf16_comm=True``: they average their pseudo-gradients in bf16 with gloo on a process group
  per quorum and each applies the outer Nesterov step;
* ``allreduce fp32`` (``--allreduce-fp32``): the same with ``bf16_comm=False``;
* ``allreduce int8`` / ``allreduce int4`` (``--allreduce-codecs int8 int4``): the workers name
  ``codec="int8"`` (``"int4"``): the quorum reduce-scatters blockwise codes with gloo's
  all-to-all, sums each shard in fp32, requantizes and all-gathers it, with each member's
  error feedback (docs/design/allreduce.md, "Quantized all-reduce").

Bytes between the members: each worker's ``sync_metrics`` ``collective_sent`` and
``collective_received`` (a quantized quorum's slots of scales and codes as moved; a dense one's
as a ring all-reduce moves them, 2(N-1)/N of the payload each way).

A round (as ``sync_round``'s): every worker perturbs its weights (standing in for local
training, outside the round), all meet at a barrier with the parent, and each times
``force_sync()``. The round's wall time runs from the earliest start after the barrier to the
latest end: the slowest worker's sync, with zero inner-step time. The all-reduce round includes
everything the worker does for it: ``POST /quorum`` until every worker asked, building the
quorum's gloo group through the rendezvous store, the pseudo-gradient, the averaging collectives,
the commit check, the outer step, the new state's hash and ``POST /quorum/outcome``.

Bytes through the server process: every worker reaches the server through a counting TCP proxy
(``harness/counting_proxy.py``, a child process relaying with ``splice``), which counts the TCP payload
each way between two readings taken while everything is idle (before the barrier is released,
after every worker reported). In all-reduce mode the rendezvous store (a ``TCPStore`` the server
process hosts on a second port) is proxied too: the server child hands out the proxy's address
in its quorum replies. So the figures are all bytes into and out of the server process during
a round, HTTP headers and JSON included. The server's own ``/status`` counters (the bodies it
counts) are shown beside them. Workers send no heartbeats in these rounds (as in
``sync_round``); ``--direct`` runs the server mode a second time without the proxy, to show
what relaying its hundreds of MB costs the round time.

Memory: each worker reads its ``ru_maxrss`` at its end (exact) and its RSS after importing torch
(``base``), shown against the fp32 model size: a server-mode worker holds the model and the
snapshot (plus transient buffers), an all-reduce worker the model, the snapshot, the outer
momentum and the averaging buffer (about 4 models).

``--kill``: a worker killed with SIGKILL inside the all-reduce (``--kill-workers`` workers,
heartbeats every ``--kill-heartbeat-interval`` s, ``ServerConfig(heartbeat_timeout=...)``). As
``tests/programs/allreduce_victim.py``, the victim patches ``QuorumCollective.collective`` to
say so and block at its first all-reduce of round ``--kill-round``; the parent kills it once
every survivor has said it is inside that all-reduce too. For each survivor: the kill until its collective failed and it
reported the round discarded, until its next quorum, and until that round completed (how long it
was blocked).

Usage (from the repository root; MB = 10**6 bytes)::

    .venv/bin/python -m benchmarks.rounds.allreduce_round --params 5e6 --workers 2 4 --kill
    .venv/bin/python -m benchmarks.rounds.allreduce_round --params 100e6 --workers 2 4 8 \\
        --allreduce-fp32 --direct --json benchmarks/results/allreduce_round_100M.json
    .venv/bin/python -m benchmarks.rounds.allreduce_round --params 20e6 --workers 2 4 \\
        --no-server-mode --allreduce-fp32 --allreduce-codecs int8 int4
    .venv/bin/python -m benchmarks.rounds.allreduce_round --smoke   # seconds: N=2 (--kill: a kill)

``--src DIR`` runs the children from another copy of the code, e.g. a snapshot of a commit
taken while others keep editing the checkout::

    mkdir -p /tmp/snap && git archive HEAD src | tar -x -C /tmp/snap
    git rev-parse HEAD > /tmp/snap/COMMIT
    .venv/bin/python -m benchmarks.rounds.allreduce_round --src /tmp/snap/src ...
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.model import ModelShape, choose_shape, write_params
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
from benchmarks.rounds.allreduce_run import Config, ConfigRun, add_args, config_run, estimate_bytes

# --- driving ---------------------------------------------------------------------------------


def run_config(
    ctx: Any, cfg: Config, n: int, shape: ModelShape, params_path: str, args: argparse.Namespace
) -> dict[str, Any]:
    with config_run(ctx, cfg, n, shape, params_path, args) as s:
        return s.measure()


def run_kill(ctx: Any, shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    cfg = Config("allreduce", not args.kill_fp32, proxied=False)
    kill = {"round": args.kill_round, "heartbeat_interval": args.kill_heartbeat_interval}
    with ConfigRun(
        ctx,
        cfg,
        args.kill_workers,
        shape,
        None,
        args,
        rounds=args.kill_round + 1 + args.kill_after,
        heartbeat_timeout=args.kill_heartbeat_timeout,
        kill=kill,
    ) as s:
        res = s.kill_inside()
    res.update(
        {
            "config": cfg.label,
            "params": shape.numel,
            "heartbeat_timeout_s": args.kill_heartbeat_timeout,
            "heartbeat_interval_s": args.kill_heartbeat_interval,
            "collective_timeout_s": args.collective_timeout,
        }
    )
    return res


def _kb(b: float) -> str:
    return f"{b / 1e3:,.1f} KB" if b < 1e6 else f"{fmt_mb(b)} MB"


def print_round_tables(results: list[dict[str, Any]], model_bytes: int) -> None:
    print_table(
        [
            "N",
            "config",
            "round s median (min-max)",
            "bytes through server per round: in / out (store in / out)",
            "server /status body bytes in / out",
            "payload averaged per worker MB",
            "sent / received per worker MB",
            "server peak RSS MB (x model)",
            "worker peak RSS MB (x model)",
            "worker peak above torch base (x model)",
            "rounds ok",
        ],
        [
            [
                str(d["workers"]),
                d["config"],
                spread(d["round_s"]),
                (
                    "-"
                    if d["server_bytes"] is None
                    else f"{_kb(d['server_bytes']['http_in'] + d['server_bytes']['store_in'])} / "
                    f"{_kb(d['server_bytes']['http_out'] + d['server_bytes']['store_out'])} "
                    f"({_kb(d['server_bytes']['store_in'])} / "
                    f"{_kb(d['server_bytes']['store_out'])})"
                ),
                f"{_kb(d['server_status_bytes']['in'])} / {_kb(d['server_status_bytes']['out'])}",
                fmt_mb(d["collective_bytes_per_worker"])
                if d["collective_bytes_per_worker"]
                else "-",
                f"{fmt_mb(d['collective_sent_per_worker'])} / "
                f"{fmt_mb(d['collective_received_per_worker'])}"
                if d.get("collective_sent_per_worker")
                else "-",
                times_model(d["server"]["maxrss"], model_bytes),
                times_model(d["worker"]["maxrss"], model_bytes),
                above_base(d["worker"], model_bytes),
                ok(d["all_rounds_ok"]),
            ]
            for d in results
        ],
    )
    print_phases(
        results,
        "config",
        "\nWhere an all-reduce round goes (s; per round the median over workers, then the\n"
        "median over rounds; quorum_wait includes waiting for the last worker to ask):",
    )
    print("\nCPU seconds per round (medians; server process, all workers, the proxy):")
    print_table(
        ["N", "config", "server", "workers", "proxy"],
        [
            [
                str(d["workers"]),
                d["config"],
                f"{d['cpu_s_median']['server']:.2f}",
                f"{d['cpu_s_median']['workers']:.2f}",
                f"{d['cpu_s_median'].get('proxy', float('nan')):.2f}",
            ]
            for d in results
        ],
    )


def print_phases(results: list[dict[str, Any]], label: str, title: str) -> None:
    """Where the all-reduce rows' rounds go: a column per phase, rows led by N and ``label``."""
    ar = [d for d in results if d["mode"] == "allreduce" and d["phases_median"]]
    if ar:
        keys = list(ar[0]["phases_median"])
        print(title)
        print_table(
            ["N", label, *keys],
            [
                [str(d["workers"]), d[label], *(f"{d['phases_median'][k]:.3f}" for k in keys)]
                for d in ar
            ],
        )


def print_kill(res: dict[str, Any]) -> None:
    print(
        f"\nKill inside the all-reduce ({res['config']}, {res['workers']} workers, "
        f"{res['params']:,} params; heartbeat timeout {res['heartbeat_timeout_s']:g} s, "
        f"heartbeats every {res['heartbeat_interval_s']:g} s, collective timeout "
        f"{res['collective_timeout_s']:g} s); seconds after the SIGKILL:"
    )
    print_table(
        [
            "survivor",
            "round failed, reported discarded",
            "next quorum formed",
            "round completed (blocked)",
            "that sync took in all",
            "later rounds s",
        ],
        [
            [
                str(s["worker"]),
                seconds(s.get("failure_reported_s")),
                seconds(s.get("next_quorum_s")),
                seconds(s.get("blocked_s")),
                seconds(s.get("round_sync_s")),
                ", ".join(f"{x:.2f}" for x in s.get("later_rounds_s", [])) or "-",
            ]
            for s in res["survivors"]
        ],
    )
    print(
        f"server: rounds completed {res['server_rounds_completed']}, discarded "
        f"{res['server_rounds_discarded']}; all inside the all-reduce "
        f"{'yes' if not res['not_inside'] else 'NO: ' + '; '.join(res['not_inside'])}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    ap.add_argument("--allreduce-fp32", action="store_true", help="also all-reduce in fp32")
    ap.add_argument(
        "--allreduce-codecs",
        nargs="*",
        default=[],
        choices=["int8", "int4", "topk"],
        help="also all-reduce with these quantized collectives",
    )
    ap.add_argument("--no-server-mode", action="store_true", help="all-reduce mode only")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="also run the server mode without the proxy (what relaying its GBs costs; the "
        "all-reduce mode's few KB cost nothing measurable)",
    )
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # both modes at N=2, one measured round (with --kill: one kill run of 2)
        args.params, args.workers, args.rounds, args.warmup = 1e5, [2], 1, 1
        args.allreduce_codecs = ["int8"]
        args.kill_workers, args.kill_round, args.kill_after = 2, 1, 1
        args.kill_repeats, args.kill_heartbeat_interval = 1, 0.5
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    configs = [] if args.no_server_mode else [Config("server", True)]
    configs.append(Config("allreduce", True))
    if args.allreduce_fp32:
        configs.append(Config("allreduce", False))
    for codec in args.allreduce_codecs:
        configs.append(Config("allreduce", True, codec=codec))
    if args.direct and not args.no_server_mode:
        configs.insert(1, Config("server", True, proxied=False))
    code = use_src(args.src)
    info = machine_info()
    started = now()
    print(
        f"{started}; model: {shape.describe()}; configurations "
        f"{', '.join(c.label for c in configs)}; rounds {args.warmup} warm-up + {args.rounds} "
        "measured",
        flush=True,
    )
    print_machine(info)
    print(f"code: {code}", flush=True)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="allreduce-bench-")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    kill: list[dict[str, Any]] | None = None
    try:
        params_path = (
            "" if args.no_server_mode else write_params(ctx, tmp, shape, args.setup_timeout)
        )
        for n in sorted(set(args.workers)):
            for cfg in configs:
                tag = f"N={n} {cfg.label}"
                if skipped_for_memory(
                    estimate_bytes(n, model_bytes, cfg), tag, args.force, skipped
                ):
                    continue
                print(f"{tag} ...", flush=True)
                t = time.monotonic()
                d = run_config(ctx, cfg, n, shape, params_path, args)
                sb = d["server_bytes"]
                print(
                    f"{tag}: round median {d['round_s']['median']:.3f} s; phases "
                    f"{d['phases_median']}; through the server per round "
                    + ("-" if sb is None else f"{sb['total']:,} B")
                    + f"; worker peak {fmt_mb(d['worker']['maxrss'])} MB; "
                    f"took {time.monotonic() - t:.0f} s",
                    flush=True,
                )
                results.append(d)
        if args.kill:
            kshape = choose_shape(args.kill_params or args.params, args.max_dim)
            cfg = Config("allreduce", not args.kill_fp32, proxied=False)
            need = estimate_bytes(args.kill_workers, kshape.nbytes, cfg)
            if not skipped_for_memory(need, "kill", args.force, skipped):
                kill = []
                for i in range(args.kill_repeats):
                    print(
                        f"kill run {i + 1}/{args.kill_repeats}: {args.kill_workers} workers, "
                        f"{kshape.numel:,} params ...",
                        flush=True,
                    )
                    kill.append(run_kill(ctx, kshape, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    if results:
        print_round_tables(results, model_bytes)
        print(
            "\nBytes through the server: TCP payload counted by a relay in front of the "
            "server's HTTP port and (all-reduce) its rendezvous store; MB = 10**6 B, KB = 10**3 B. "
            f"Model = {fmt_mb(model_bytes)} MB fp32."
        )
    for k in kill or []:
        print_kill(k)
    if args.json:
        write_json(
            args.json,
            {
                **run_head("allreduce_round", started, info),
                "code": code,
                "model": {**shape.record(), "fp32_bytes": model_bytes},
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "round_definition": "max over workers of force_sync() end - min over workers "
                "of its start, after a barrier (zero inner-step time)",
                "results": results,
                "kill": kill,
                "skipped": skipped,
            },
        )
    if args.smoke:
        check_smoke(results, kill or [])
    return 0


def check_smoke(results: list[dict[str, Any]], kills: list[dict[str, Any]]) -> None:
    """Both modes ran consistent rounds through the proxy (the model's bytes through the server
    in server mode, a few KB and an averaged payload in all-reduce mode), and after a kill (with
    ``--kill``) every survivor completed a round again."""
    modes = {d["mode"] for d in results}
    smoke.require(modes == {"server", "allreduce"}, f"both modes ran (got {modes})")
    for d in results:
        smoke.require(d["all_rounds_ok"], f"{d['config']}: every round consistent")
        smoke.require(d["server_bytes"]["total"] > 0, f"{d['config']}: bytes counted")
        if d["mode"] == "allreduce":
            smoke.require(d["collective_bytes_per_worker"] > 0, "the workers averaged a payload")
            smoke.require(d["collective_sent_per_worker"] > 0, f"{d['config']}: bytes sent")
    quantized = [d for d in results if d["comm"] == "int8"]
    smoke.require(len(quantized) == 1, "the int8 collectives ran")
    dense = [d for d in results if d["config"] == "allreduce bf16"][0]
    smoke.require(
        quantized[0]["collective_sent_per_worker"] < dense["collective_sent_per_worker"],
        "int8 sends fewer bytes than bf16",
    )
    for k in kills:
        smoke.require(not k["not_inside"], "every worker reached the all-reduce")
        for s in k["survivors"]:
            smoke.require(s.get("blocked_s") is not None, f"survivor {s['worker']} went on")
    smoke.passed("allreduce_round")


if __name__ == "__main__":
    sys.exit(main())
