"""The parent's side of ``torchft_diloco``: torchft's lighthouse and N replicas as a run.

``TorchftRun`` starts the lighthouse and the replicas (``torchft_children``) as a
``harness.session.Session`` and drives them one round at a time, or, in a kill run, lets them
sync back to back and SIGKILLs the last one inside a chosen round's all-reduce, then reads each
survivor's log of syncs against the moment of the kill.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.harness.model import ModelShape
from benchmarks.harness.report import summary
from benchmarks.harness.session import SessionRun, median_phases
from benchmarks.rounds.torchft_children import lighthouse_main, replica_main


class TorchftRun(SessionRun):
    """A lighthouse process and N replica processes (a ``Session``), driven one round at a time
    (or, with ``kill``, left to run until the victim is killed)."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        shape: ModelShape,
        args: argparse.Namespace,
        *,
        rounds: int,
        kill: dict[str, Any] | None = None,
        join_timeout_s: float | None = None,
    ) -> None:
        super().__init__(ctx, n, args, rounds=rounds, kill=kill)
        self.shape, self.join_timeout_s = shape, join_timeout_s
        self.min_replicas = n - 1 if kill is not None else n

    def __exit__(self, *exc: object) -> None:
        self.session.tell_hub("stop")
        super().__exit__()

    def _start(self) -> None:
        args, s = self.args, self.session
        join_ms = None if self.join_timeout_s is None else int(self.join_timeout_s * 1000)
        self.hello = s.start_hub(lighthouse_main, (self.min_replicas, join_ms, None), "lighthouse")
        self.ready = s.start_members(
            replica_main,
            lambda i: (
                self.hello["address"],
                self.shape,
                self.min_replicas,
                args.torchft_timeout,
                args.torchft_quorum_timeout,
                *self.pace_of(i),
            ),
            "replica",
        )

    def round(self) -> dict[str, Any]:
        n, args = self.n, self.args
        r = len(self.rounds)
        what = f"N={n} torchft round {r}"
        msgs, cpu = self.session.start_round(what)
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "wall_s": max(m["t1"] for m in msgs.values()) - min(m["t0"] for m in msgs.values()),
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": {"lighthouse": cpu["server"], "workers": cpu["workers"]},
            "phases": median_phases([m["phases"] for m in msgs.values()]),
            "committed": [m["committed"] for m in msgs.values()],
            "consistent": len({m["checksum"] for m in msgs.values()}) == 1,
        }
        self.rounds.append(result)
        if args.verbose:
            print(f"    {what}: {result['wall_s']:.3f} s {result['phases']}", flush=True)
        return result

    def finish(self) -> dict[str, Any]:
        n = self.n
        done = self.session.finish_members("replica shutdown")
        measured = [r for r in self.rounds if not r["warmup"]]
        return {
            "config": "torchft fp32",
            "workers": n,
            "rounds": self.rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "phases_median": median_phases([r["phases"] for r in measured]),
            "cpu_s_median": {
                k: statistics.median(r["cpu_s"][k] for r in measured)
                for k in ("lighthouse", "workers")
            },
            "all_rounds_ok": all(
                r["consistent"] and all(c == 1 for c in r["committed"]) for r in self.rounds
            ),
            "worker": self.session.member_memory(done),
        }

    def kill_inside(self) -> dict[str, Any]:
        n, args = self.n, self.args
        self.session.barrier.wait(self.setup_timeout + args.round_timeout)  # they start together
        k = self.kill_victim()
        t_kill, done = k.t_kill, k.done
        survivors = []
        for i in sorted(done):
            log = done[i]["log"]
            after = [e for e in log if e["t1"] > t_kill]
            hit = next((e for e in after if e["committed"]), None)
            first = after[0] if after else None
            errors = [e for e in log if e["error"]]
            survivors.append(
                {
                    "worker": i,
                    "raised": (
                        None
                        if not errors
                        else {"s_after_kill": errors[0]["t1"] - t_kill, "error": errors[0]["error"]}
                    ),
                    "syncs": len(log),
                    "failed_sync_ended_s": None if first is None else first["t1"] - t_kill,
                    "failed_sync_committed": None if first is None else bool(first["committed"]),
                    "failed_sync_participants": None if first is None else first["participants"],
                    "next_quorum_s": (
                        None
                        if hit is None or "quorum" not in hit["stamps"]
                        else hit["stamps"]["quorum"] - t_kill
                    ),
                    "blocked_s": None if hit is None else hit["t1"] - t_kill,
                    "uncommitted_syncs_after_kill": sum(
                        1
                        for e in after
                        if not e["committed"] and (hit is None or e["t1"] < hit["t1"])
                    ),
                    "later_syncs_s": [
                        e["t1"] - e["t0"] for e in after if hit is not None and e["t0"] > hit["t1"]
                    ],
                }
            )
        return {
            "workers": n,
            "victim": n - 1,
            "kill_round": self.kill["round"] if self.kill else None,
            "join_timeout_s": self.join_timeout_s,
            "timeout_s": args.torchft_timeout,
            "quorum_timeout_s": args.torchft_quorum_timeout,
            "inside_before_kill_s": k.inside_before_kill_s,
            "not_inside": k.not_inside,
            "survivors": survivors,
            "worker_maxrss": k.worker_maxrss,
            "logs": k.logs(
                lambda e: {
                    "committed": e["committed"],
                    "participants": e["participants"],
                    "stamps": {key: v - t_kill for key, v in e["stamps"].items()},
                    "error": e["error"],
                }
            ),
        }


def run_torchft(ctx: Any, n: int, shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    with TorchftRun(ctx, n, shape, args, rounds=args.warmup + args.rounds) as s:
        return s.measure()


def run_torchft_kill(
    ctx: Any, shape: ModelShape, args: argparse.Namespace, join_timeout_s: float | None
) -> dict[str, Any]:
    kill = {"round": args.kill_round}
    rounds = args.kill_round + 1 + args.kill_after
    with TorchftRun(
        ctx, args.kill_workers, shape, args, rounds=rounds, kill=kill, join_timeout_s=join_timeout_s
    ) as s:
        res = s.kill_inside()
    res["params"] = shape.numel
    return res
