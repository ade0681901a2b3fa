"""Chaos run of the all-reduce mode (issue 19): kill -9 workers and the server while the workers
average among themselves, and check that no worker hangs and no replicas diverge.

    python -m benchmarks.faults.chaos_allreduce --workers 4 --duration 300 --seed 0 \\
        --txt benchmarks/results/chaos_allreduce_seed0.txt \\
        --json benchmarks/results/chaos_allreduce_seed0.json

A ``diloco server --allreduce`` child on a fixed port (a restart keeps the address) and
``--workers`` worker children training the demo model (``chaos``'s loop) with a
small ``--sync-every``. A seeded schedule (``chaos_allreduce_schedule.py``) whose clock starts
once every worker has joined (not at the script's start: joining takes tens of seconds on a
loaded machine), ``--first-fault`` seconds in and then every ``--fault-min`` to ``--fault-max``
seconds after the previous fault was dealt with, either kills the server with SIGKILL and starts it again on the same
port (``--server-share`` of the faults), or kills a random worker with SIGKILL and starts a
replacement for its data shard, under a fresh worker id (a joiner, ``--fresh-share`` of them)
or under the same id. Faults stop ``--settle`` seconds before the end (``--duration`` seconds of
training, longer where dealing with the faults took longer than planned: every planned fault
fires), then every worker is asked to stop at its next completed sync, evaluates the run's
parameters and leaves.

Kills are "aimed" with probability ``--aim-share``: the driver polls ``/status`` until a quorum
is open (for a worker kill, one the victim is a member of) and kills 0 to ``--aim-delay``
seconds later, inside the round (rendezvous, broadcast, all-reduce or commit); the others land
wherever the clock puts them, mostly during local training.

Each worker prints one JSON line to its stdout after every completed sync (``opt.step()``
returned with ``local_step == 0``): the round it now holds (``base_round``), the quorum that
completed it (its client records the last ``POST /quorum`` reply), a CRC of its model's
parameters (``wire.checksum.tensor_checksum``; right after a sync they are the run's global
parameters) and the strategy's hash of parameters and outer momentum. The driver checks:

- replicas diverged: the members of one completed quorum report different CRCs or hashes;
  also the server's own "ended with another state than the majority's" log lines;
- forked rounds: one round number reached with different states by different quorums (the
  run's state was lost, every worker holding it left, and the run went on from an older one);
- hangs: for every worker process, the longest time without a completed sync (from its start);
  one longer than ``heartbeat_timeout + 3 x collective_timeout + poll_timeout`` plus
  ``--stall-slack`` (a sync period, a process start, a server restart) is a hang: the
  process's Python stacks are dumped to its log (faulthandler, SIGUSR1). The server is
  watched too (``/status`` polled each second): a live server silent that long is a hang;
- rounds: the server's ``quorum ... completed`` lines that advanced the round and its
  ``discarded`` lines, over all its lives (each life counts from 0; its last ``/status`` agrees
  up to the moment it was killed), the highest round any worker reached, and the rounds a
  restarted server let a quorum complete before every running worker had re-registered.

Streaming fragments (``--fragments P`` > 1, with ``--overlap`` tau and ``--alpha``, passed to
every worker's ``DiLoCoWorker`` and ``--num-fragments`` to the server): round ``r`` averages
fragment ``r mod P``, on a background thread when tau > 0. The workers' models then differ by
design (each keeps its local progress on the fragments not just merged), so the checks above
compare the shared state instead: the strategy's hash of snapshot and outer momentum, and its
round. A sync is reported once a round completed and its fragment was merged (``SyncWatch``).

The children import ``diloco`` from a copy of ``src/`` taken at the start (``PYTHONPATH``), so
edits to the working tree during a run cannot reach them.

Logs (server, each worker process) go to ``--logs`` (default: a new temporary folder, kept).
The exit status is 1 when a hang, a crashed worker, diverged replicas or a forked round was
found. Not part of the test suite: it takes minutes.
"""

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.faults.chaos_adversary import ADVERSARIES, BAD_WORKER
from benchmarks.faults.chaos_allreduce_record import compared
from benchmarks.faults.chaos_allreduce_run import Run
from benchmarks.faults.chaos_allreduce_server import short_reason
from benchmarks.faults.chaos_allreduce_worker import parse_worker_args, worker_main
from benchmarks.harness import smoke
from benchmarks.harness.report import table_lines, write_json
from benchmarks.harness.source import snapshot_source


def what_differs(cfg: dict[str, Any]) -> str:
    """What tells the workers' replicas apart in the report: CRCs of the models (plain) or
    states (streaming fragments)."""
    return "CRCs" if cfg["fragments"] == 1 else "states"


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"all-reduce chaos run: {c['workers']} workers, sync every {c['sync_every']}, "
        f"{c['duration']:.0f} s ({c['settle']:.0f} s without faults at the end), seed {c['seed']}",
        f"server: --heartbeat-timeout {c['heartbeat_timeout']} --collective-timeout "
        f"{c['collective_timeout']} --poll-timeout {c['poll_timeout']} --join-timeout "
        f"{c['join_timeout']}; faults every {c['fault_min']}-{c['fault_max']} s, "
        f"{c['server_share']:.0%} of them the server, {c['fresh_share']:.0%} of worker "
        f"replacements under a fresh id, {c['aim_share']:.0%} aimed at an open quorum "
        f"(+0-{c['aim_delay']} s)",
    ]
    if c["fragments"] > 1:
        lines.append(
            f"streaming: {c['fragments']} fragments, overlap {c['overlap']} steps, alpha "
            f"{c['alpha']}; replicas compared by their state (hash of snapshot and momentum) "
            "and its round, not their models"
        )
    adv = res["adversary"]
    if adv["kind"]:
        lines.append(
            f"adversary: {adv['kind']} (worker {BAD_WORKER!r} faulty from step "
            f"{adv['fault_step']}, left out of the replica checks below)"
            if adv["kind"] != "stranger"
            else "adversary: a stranger without the token, on every route and worker port"
        )
    lines.append("")
    ends = [w["final"] for w in res["workers_detail"] if w["final"] and w["final"]["at_sync"]]
    rounds = sorted({f["round"] for f in ends})
    held = {compared(f["crc"], f.get("state"), c["fragments"]) for f in ends}
    finals = f"{len(ends)} at {','.join(map(str, rounds))} / {len(held)}"
    rows = [
        ("rounds completed (server log, all lives)", res["rounds_completed"]),
        ("rounds completed (last /status of each life)", res["rounds_completed_status"]),
        ("rounds discarded (server log, all lives)", res["rounds_discarded"]),
        ("rounds made by a restarted server before all re-registered", res["restart_early_rounds"]),
        ("max round reached", res["max_round"]),
        ("worker kills (SIGKILL)", res["worker_kills"]),
        ("  replaced by a joiner (fresh id)", res["joiners"]),
        ("  restarted under the same id", res["same_id_restarts"]),
        ("server kills (SIGKILL, restart same port)", res["server_kills"]),
        ("kills landed while a quorum was open", res["kills_in_quorum"]),
        (f"hangs (no sync for > {res['hang_limit_s']:.0f} s)", len(res["hangs"])),
        ("longest stall of any worker, s", res["longest_stall_s"]),
        ("replicas diverged (quorums whose members differ)", len(res["diverged_quorums"])),
        ("server: a member's hash not the majority's", len(res["majority_differs"])),
        ("forked rounds (a round reached twice, differently)", len(res["forked_rounds"])),
        ("final eval loss (nats/byte)", res["final_eval_loss"]),
        (f"workers at the end: at round / distinct {what_differs(c)}", finals),
        ("wall time, s", res["wall_s"]),
    ]
    if adv["kind"]:
        rows += [
            ("honest workers' final states finite", adv["honest_finals_finite"]),
            ("honest syncs after the first fault", adv["honest_syncs_after_first_fault"]),
            ("first honest sync after the first fault, s", adv["wait_after_first_fault_s"]),
            ("faulty worker's syncs reported", adv["bad_syncs"]),
            ("faulty worker's exits", adv["bad_exits"]),
            (
                "server log: contributions left out / workers left out / unagreed claims",
                " / ".join(
                    str(adv["server_defences"][k]) for k in ("excluded", "left_out", "unagreed")
                ),
            ),
        ]
        if adv["stranger"]:
            st = adv["stranger"]
            rows += [
                ("stranger: HTTP requests / accepted", f"{st['http']} / {st['http_accepted']}"),
                ("stranger: connections to worker ports", st["tcp"]),
            ]
    lines += table_lines(
        ["", "value"], [[k, f"{v:.4f}" if isinstance(v, float) else str(v)] for k, v in rows]
    )
    sizes = {int(k): v for k, v in res["quorum_sizes"].items()}  # JSON made the keys strings
    lines += ["", f"quorums formed, by members: {sizes}"]
    lines += ["discard reasons (server log):"]
    reasons: dict[str, int] = {}
    for reason, n in res["discard_reasons"].items():
        reasons[short_reason(reason)] = reasons.get(short_reason(reason), 0) + n
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:>4}  {reason}")
    lines.append("")
    lines += table_lines(
        ["worker", "joiner", "killed", "syncs", "rounds", "join_s", "stall_s"],
        [
            [
                w["worker"],
                "yes" if w["joiner"] else "",
                "yes" if w["killed"] else "",
                str(w["syncs"]),
                f"{w['first_round']}-{w['last_round']}" if w["syncs"] else "-",
                str(w["join_s"]) if w["join_s"] is not None else "-",
                str(w["longest_stall_s"]),
            ]
            for w in res["workers_detail"]
        ],
    )
    if res["hangs"]:
        lines += ["", "HANGS:", *(json.dumps(h) for h in res["hangs"])]
    if res["diverged_quorums"]:
        lines += ["", "DIVERGED:", *(f"{q}: {v}" for q, v in res["diverged_quorums"].items())]
    if res["forked_rounds"]:
        lines += ["", "FORKED:", *(f"round {r}: {v}" for r, v in res["forked_rounds"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker program, started by the driver
        return worker_main(parse_worker_args(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of training")
    parser.add_argument("--settle", type=float, default=30.0, help="fault-free seconds at the end")
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-min", type=float, default=5.0)
    parser.add_argument("--fault-max", type=float, default=15.0)
    parser.add_argument(
        "--first-fault", type=float, default=20.0, help="training seconds before the first"
    )
    parser.add_argument("--server-share", type=float, default=0.3)
    parser.add_argument("--fresh-share", type=float, default=0.5)
    parser.add_argument(
        "--aim-share",
        type=float,
        default=0.5,
        help="share of kills that wait for an open quorum (with the victim in it) first",
    )
    parser.add_argument(
        "--aim-delay",
        type=float,
        default=0.05,
        help="an aimed kill lands uniformly this many seconds after the quorum is seen open",
    )
    parser.add_argument(
        "--aim-wait", type=float, default=5.0, help="longest wait for an open quorum, s"
    )
    parser.add_argument("--no-faults", action="store_true", help="a fault-free run, for scale")
    parser.add_argument("--heartbeat-timeout", type=float, default=6.0)
    parser.add_argument("--collective-timeout", type=float, default=10.0)
    parser.add_argument("--poll-timeout", type=float, default=5.0)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    parser.add_argument(
        "--stall-slack",
        type=float,
        default=15.0,
        help="added to the hang limit: a sync period, process start, a server restart",
    )
    parser.add_argument("--final-wait", type=float, default=60.0)
    parser.add_argument(
        "--fragments", type=int, default=1, help="streaming fragments P (1: plain all-reduce)"
    )
    parser.add_argument(
        "--overlap", type=int, default=0, help="streaming: overlap tau, inner steps"
    )
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="streaming: local share alpha in merges"
    )
    parser.add_argument(
        "--adversary",
        choices=ADVERSARIES,
        help="one faulty party besides the honest workers (issue 26): a worker whose model "
        "goes NaN or +1e30, that claims 1e300 samples, claims round + 1000 with its own state, "
        "whose joins always fail, that dies between commit point and report; or a stranger "
        "without the token hammering routes and the workers' ports",
    )
    parser.add_argument(
        "--fault-step", type=int, default=12, help="the faulty worker's first faulty step"
    )
    parser.add_argument("--logs", help="folder for the logs (default: a temporary one)")
    parser.add_argument("--json")
    parser.add_argument("--txt")
    smoke.add_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:  # 3 workers, 25 training s with faults planned from 8 s to 17 s
        args.workers, args.duration, args.settle, args.first_fault = 3, 25.0, 8.0, 8.0
        args.fault_min, args.fault_max, args.final_wait = 3.0, 4.0, 20.0
    if args.fragments > 1 and args.overlap >= args.sync_every // args.fragments:
        parser.error(  # SyncWatch needs steps with no round in flight
            f"--overlap must be below sync_every / fragments = {args.sync_every // args.fragments}"
        )
    cfg = {
        "workers": args.workers,
        "duration": args.duration,
        "settle": args.settle,
        "sync_every": args.sync_every,
        "seed": args.seed,
        "lr": 3e-3,
        "fault_min": args.fault_min,
        "fault_max": args.fault_max,
        "first_fault": args.first_fault,
        "server_share": args.server_share,
        "fresh_share": args.fresh_share,
        "aim_share": args.aim_share,
        "aim_delay": args.aim_delay,
        "aim_wait": args.aim_wait,
        "chaos": not args.no_faults,
        "heartbeat_timeout": args.heartbeat_timeout,
        "collective_timeout": args.collective_timeout,
        "poll_timeout": args.poll_timeout,
        "join_timeout": args.join_timeout,
        "stall_slack": args.stall_slack,
        "final_wait": args.final_wait,
        "fragments": args.fragments,
        "overlap": args.overlap,
        "alpha": args.alpha,
        "adversary": args.adversary,
        "fault_step": args.fault_step,
        "token": secrets.token_hex(16),
        "weighting": "samples" if args.adversary == "weight" else "equal",
    }
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="chaos_allreduce_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", file=sys.stderr, flush=True)
    source = snapshot_source(logs / "src")
    cfg["env"] = {**os.environ, "PYTHONPATH": str(logs / "src")}
    res = Run(cfg, logs).go()
    res["config"].pop("env")
    res["source"] = source
    res["logs"] = str(logs)
    text = report(res)
    print("\n" + text)
    if args.txt:
        Path(args.txt).write_text(text + "\n")
    if args.json:
        write_json(args.json, res)
    if args.smoke:
        check_smoke(res)
    bad = res["hangs"] or res["worker_crashes"] or res["diverged_quorums"] or res["forked_rounds"]
    return 1 if bad else 0


def check_smoke(res: dict[str, Any]) -> None:
    """Faults were injected, rounds completed, and the run found nothing wrong: no hang, no
    crashed worker, no diverged replicas, no forked round; the workers that ended at a sync of
    the same round hold one state (one that stopped a round earlier, its quorum's last round
    formed without it, rightly holds the state before)."""
    smoke.require(res["worker_kills"] + res["server_kills"] >= 1, "faults were injected")
    smoke.require(res["rounds_completed"] >= 1, "rounds completed")
    for what in ("hangs", "worker_crashes", "diverged_quorums", "forked_rounds"):
        smoke.require(not res[what], f"no {what}: {res[what]}")
    ends = [w["final"] for w in res["workers_detail"] if w["final"] and w["final"]["at_sync"]]
    held: dict[int, set[tuple[str | None, str | None]]] = {}
    for f in ends:
        held.setdefault(f["round"], set()).add(
            compared(f["crc"], f.get("state"), res["config"]["fragments"])
        )
    smoke.require(
        bool(ends) and all(len(states) == 1 for states in held.values()),
        f"the workers that ended at the same round hold one state ({held})",
    )
    adv = res["adversary"]
    if adv["kind"]:
        smoke.require(adv["honest_finals_finite"], "the honest workers end finite")
        smoke.require(
            adv["kind"] == "join-fails"
            or adv["honest_syncs_after_first_fault"] >= 1
            or not adv["faults"],
            "the honest workers progress after the fault",
        )
        if adv["stranger"]:
            smoke.require(adv["stranger"]["http_accepted"] == 0, "no stranger's request accepted")
    smoke.passed("chaos_allreduce")


if __name__ == "__main__":
    sys.exit(main())
