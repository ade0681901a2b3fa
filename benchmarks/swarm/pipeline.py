"""Pipeline swarm: the demo's character model in 3 stages through a real ``--swarm`` server.

    python -m benchmarks.swarm.pipeline --steps 300
    python -m benchmarks.swarm.pipeline --smoke     # a few steps of each part, checked

The demo model (``diloco.demo.sequential``: embedding, 2 blocks, head; 137k parameters) is cut
by ``split_sequential`` into 3 stages (the head stage takes the token ids); one ``SwarmPeer``
per stage replica joined through an in-process coordinator, no stage sync. The peers are threads
of this process, except in the throughput runs marked "stages in processes" (stages 1 and 2 in
spawned children: ``peer_procs``), which show what sharing one GIL costs. Printed, as tables:

* step throughput (samples/s) of the swarm, 1 replica per stage, against the unsplit model in
  this process, on the same batches of ``pydoc_data.topics``, and each run's held-out loss
  (int8 boundaries against fp32);
* where a swarm step's time goes: each stage's forward and backward and the boundary codecs,
  timed alone, against the step's measured time;
* bytes per token per boundary and direction (int8 and fp32), as the peers counted them;
* recovery: a body replica killed mid-step (its connections reset) and one frozen mid-step
  (the driver's call timeout printed beside it), micro-batches lost; a joining replica's time
  to appear in the head's routes (the coordinator's table).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import (
    machine_info,
    now,
    print_machine,
    print_table,
    run_head,
    write_json,
)
from benchmarks.swarm.demo_swarm import (
    D_MODEL,
    SEQ,
    STAGES,
    Setup,
    batches,
    held_out,
    loss_fn,
    swarm,
    train_swarm,
    train_unsplit,
)
from benchmarks.swarm.faults import fault, faults_table, join
from benchmarks.swarm.peer_procs import process_swarm
from diloco.demo.data import build_corpus
from diloco.demo.sequential import build_sequential
from diloco.swarm import split_sequential
from diloco.swarm.boundary import BoundaryCodec, BoundarySpec

# --- throughput and loss -----------------------------------------------------------------------


def unsplit(args: Any, corpus: Any, data: list[Any], name: str) -> dict[str, Any]:
    model, seconds = train_unsplit(data, args.warmup, Setup(seed=args.seed))
    timed = args.steps - args.warmup
    return {
        "run": name,
        "samples_s": timed * args.batch / seconds,
        "loss": held_out(model, corpus.eval, args.windows),
        "step_ms": seconds * 1e3 / timed,
    }


def swarm_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "codec" in r]


def throughput(args: Any, corpus: Any) -> list[dict[str, Any]]:
    """The unsplit model, each swarm configuration, the unsplit model again (the machine is
    shared: the two unsplit runs bracket the swarm's), on the same batches."""
    data = batches(corpus.shards[0], args.steps, args.batch, args.seed)
    timed = (args.steps - args.warmup) * args.batch
    rows = [unsplit(args, corpus, data, "unsplit, one process (before)")]
    for codec, micro, in_flight, procs in args.configs:
        setup = Setup(
            seed=args.seed, batch=args.batch, micro_batch=micro, in_flight=in_flight, codec=codec
        )
        where = ", stages in processes" if procs else ""
        with process_swarm(setup) if procs else swarm(setup) as s:
            got = train_swarm(s, data, args.warmup)
            rows.append(
                {
                    "run": f"swarm {codec}, micro-batch {micro}, {in_flight} in flight{where}",
                    "samples_s": timed / got["seconds"],
                    "loss": held_out(s.joined(args.seed), corpus.eval, args.windows),
                    "step_ms": got["seconds"] * 1e3 / (args.steps - args.warmup),
                    "codec": codec,
                    "micro_batch": micro,
                    "in_flight": in_flight,
                    "processes": procs,
                    "sent": s.sent(),
                }
            )
    rows.append(unsplit(args, corpus, data, "unsplit, one process (after)"))
    # The faster unsplit run is the base: a shared machine only ever slows a run down.
    base = max(r["samples_s"] for r in rows if "codec" not in r)
    print_table(
        ["run", "samples/s", "x unsplit", "ms a step", "held-out loss"],
        [
            [
                r["run"],
                f"{r['samples_s']:.0f}",
                f"{r['samples_s'] / base:.2f}",
                f"{r['step_ms']:.1f}",
                f"{r['loss']:.3f}",
            ]
            for r in rows
        ],
    )
    return rows


HOPS = {
    "0->1:forward": "0->1 forward: head -> stage 1",
    "1->2:out:forward": "1->2 forward: stage 1 -> head (reply)",
    "1->2:forward": "1->2 forward: head -> stage 2 (+ int64 targets)",
    "1->2:in:backward": "1->2 backward: stage 2 -> head (reply, + loss)",
    "1->2:backward": "1->2 backward: head -> stage 1",
    "0->1:in:backward": "0->1 backward: stage 1 -> head (reply)",
}
"""The peers' ``sent`` keys, as the hops they are: the head relays every boundary, so the
boundary 1->2 crosses two links each way."""


def bytes_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Bytes per token of each hop, one column per swarm run (bodies' headers included)."""
    swarm_rows = [r for r in swarm_runs(rows) if r["sent"]]  # processes' counts stay there
    out = [
        [
            label,
            *(
                f"{r['sent'][key]['bytes'] / max(1, r['sent'][key]['tokens']):.1f}"
                if key in r["sent"]
                else "-"
                for r in swarm_rows
            ),
        ]
        for key, label in HOPS.items()
    ]
    print_table(["boundary, direction, hop", *(r["run"] for r in swarm_rows)], out)
    return out


# --- where the time goes -----------------------------------------------------------------------


def _timed(fn: Any, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def breakdown(args: Any, rows: list[dict[str, Any]], corpus: Any) -> list[dict[str, Any]]:
    """Per step, for each swarm run: the stages' forward+backward and the codecs' encode+decode
    timed alone on one micro-batch, times the micro-batches of a step; the rest of the
    measured step is the calls' own cost (HTTP, threads, the GIL)."""
    stages = split_sequential(build_sequential(args.seed), STAGES)
    out = []
    for r in swarm_runs(rows):
        m = r["micro_batch"]
        x, y = batches(corpus.shards[0], 1, m, args.seed + 1)[0]
        acts, compute = [x], []
        with torch.no_grad():
            for st in stages[:-1]:
                acts.append(st(acts[-1]))

        for k, st in enumerate(stages):
            a = acts[k] if k == 0 else acts[k].clone().requires_grad_()

            def fwd_bwd(st: Any = st, a: Any = a, k: int = k, y: Any = y) -> None:
                out_ = st(a)
                (loss_fn(out_, y) if k == STAGES - 1 else out_.sum()).backward()

            compute.append(_timed(fwd_bwd, args.reps))
            st.zero_grad()
        codec = BoundaryCodec(BoundarySpec("b", (SEQ, D_MODEL)), r["codec"])
        t = torch.randn(m, SEQ, D_MODEL)
        one = _timed(lambda c=codec, t=t: c.decode(c.encode(t)), args.reps)
        per_step = args.batch // m
        parts = [c * per_step * 1e3 for c in compute] + [one * 2 * (STAGES - 1) * per_step * 1e3]
        out.append(
            {
                "run": r["run"],
                "step_ms": r["step_ms"],
                "stages_ms": parts[:STAGES],
                "codec_ms": parts[-1],
                "rest_ms": r["step_ms"] - sum(parts),
            }
        )
    print_table(
        [
            "run",
            "step ms",
            "head f+b",
            "stage 1 f+b",
            "stage 2 f+b (loss)",
            "codecs",
            "rest (calls)",
        ],
        [
            [
                b["run"],
                f"{b['step_ms']:.1f}",
                *(f"{v:.1f}" for v in b["stages_ms"]),
                f"{b['codec_ms']:.1f}",
                f"{b['rest_ms']:.1f}",
            ]
            for b in out
        ],
    )
    return out


# --- the run ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--windows", type=int, default=256, help="held-out windows of 64 bytes")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the breakdown's timings")
    ap.add_argument(
        "--timeout-floor", type=float, default=1.0, help="the driver's least call timeout (s)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of this process (0: torch's default; more than one spins against "
        "the other threads on a busy 2-core machine)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/swarm_pipeline.json")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.windows, args.reps = 4, 1, 16, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    # (codec, micro-batch, in flight, stages in processes)
    args.configs = [
        ("fp32", 4, 4, False),
        ("int8", 4, 4, False),
        ("int8", 16, 1, False),
        ("int8", 4, 4, True),
        ("int8", 16, 1, True),
    ]
    date, machine = now(), machine_info()
    print(f"# Pipeline swarm, {date}", flush=True)
    print_machine(machine)
    print(
        f"torch threads: {torch.get_num_threads()}, steps {args.steps} (first {args.warmup} untimed), batch {args.batch} x {SEQ} bytes\n"
    )
    corpus = build_corpus(1)
    rows = throughput(args, corpus)
    print()
    bytes_rows = bytes_table(rows)
    print()
    parts = breakdown(args, rows, corpus)
    print()
    kill, freeze, joined = fault(args, corpus, "kill"), fault(args, corpus, "freeze"), join(args)
    faults_table(kill, freeze, joined)
    if args.smoke:
        check(rows, kill, freeze, joined)
        smoke.passed("swarm.pipeline")
        return
    write_json(
        args.out,
        {
            **run_head("swarm_pipeline", date, machine),
            "steps": args.steps,
            "throughput": rows,
            "bytes": bytes_rows,
            "breakdown": parts,
            "kill": kill,
            "freeze": freeze,
            "join": joined,
        },
    )


def check(
    rows: list[dict[str, Any]], kill: dict[str, Any], freeze: dict[str, Any], joined: dict[str, Any]
) -> None:
    smoke.require(
        all(r["samples_s"] > 0 and r["loss"] == r["loss"] for r in rows),
        "every run trained, finite losses",
    )
    per = {r["codec"]: r["sent"]["0->1:forward"] for r in swarm_runs(rows) if r["sent"]}
    int8, fp32 = (per[c]["bytes"] / per[c]["tokens"] for c in ("int8", "fp32"))
    smoke.require(
        D_MODEL + 2 <= int8 < D_MODEL + 4 and 4 * D_MODEL <= fp32 < 4 * D_MODEL + 2,
        f"bytes per token int8 {int8:.1f}, fp32 {fp32:.1f}",
    )
    smoke.require(kill["lost"] == 0 and freeze["lost"] == 0, "no micro-batch lost")
    smoke.require(
        kill["recoveries"] >= 1 and freeze["recoveries"] >= 1, "finished micro-batches replayed"
    )
    smoke.require(
        freeze["recovery_s"] <= freeze["timeout_s"] + 1.0,
        "a frozen replica left within its timeout + 1 s",
    )
    smoke.require(joined["seen"], "the joiner appeared in the head's routes")


if __name__ == "__main__":
    main()
