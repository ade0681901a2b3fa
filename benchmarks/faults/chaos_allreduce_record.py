"""What one chaos_allreduce run observed, and its summary.

``Record`` holds the worker processes (``Worker``: each one's completed syncs, stalls, final
report), the driver's event log and counts, the hangs and crashes seen, and sums them up
(``Record.summary``): the replicas of each completed quorum must hold one state, no round may be
reached twice with different states, no worker may stall past the hang limit. ``Fleet``
(``chaos_allreduce_fleet.py``) and ``Run`` (``chaos_allreduce_run.py``) fill it in.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.faults.chaos_adversary import BAD_WORKER
from benchmarks.faults.chaos_allreduce_server import Server


def compared(crc: str | None, state: str | None, fragments: int) -> tuple[str | None, str | None]:
    """What the members of one completed quorum must share, and what tells one round's states
    apart: the model's CRC and the state's hash; with streaming fragments the state's hash alone
    (the models differ by design, each keeping its progress on the fragments not just merged)."""
    return (crc if fragments == 1 else None), state


@dataclass
class Worker:
    """One worker process (an incarnation of a data shard's slot)."""

    slot: int
    worker_id: str
    incarnation: int
    joiner: bool  # a fresh id started after the run began
    proc: subprocess.Popen[str]
    started: float
    log: Path
    syncs: list[tuple[float, int, str, str | None, str | None]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    joined_at: float | None = None
    last_progress: float = 0.0
    longest_stall: float = 0.0
    longest_stall_end_round: int | None = None
    dumped: bool = False
    killed: bool = False
    exited: bool = False
    faults: list[dict[str, Any]] = field(default_factory=list)  # a faulty worker's "fault" events

    @property
    def honest(self) -> bool:
        return self.worker_id != BAD_WORKER

    @property
    def name(self) -> str:
        return f"{self.worker_id}#{self.incarnation}"


class Record:
    """The run's observations; ``now`` and ``note`` stamp them in seconds since it began."""

    def __init__(self, cfg: dict[str, Any], server: Server) -> None:
        self.cfg, self.server = cfg, server
        self.workers: list[Worker] = []
        self.events: list[dict[str, Any]] = []
        self.counts = {
            "worker_kills": 0,
            "server_kills": 0,
            "joiners": 0,
            "same_id_restarts": 0,
            "kills_in_quorum": 0,
        }
        c = cfg
        self.hang_limit = (
            c["heartbeat_timeout"] + 3 * c["collective_timeout"] + c["poll_timeout"]
        ) + c["stall_slack"]
        self.server_longest_silence = 0.0
        self.hangs: list[dict[str, Any]] = []
        self.crashes: list[dict[str, Any]] = []
        self.adversary_exits: list[dict[str, Any]] = []  # the faulty worker's own exits
        self.stranger: dict[str, Any] = {}
        self.stranger_since: float | None = None  # when the stranger began
        self.sources: set[str] = set()  # where the workers imported diloco from
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def note(self, what: str, /, **info: Any) -> None:
        ev = {"t": self.now(), "event": what, **info}
        self.events.append(ev)
        print(json.dumps(ev), file=sys.stderr, flush=True)

    def summary(self) -> dict[str, Any]:
        # Replicas: the members of one completed quorum must hold the same state after it.
        by_quorum: dict[str, dict[tuple[int, str | None, str | None], list[str]]] = {}
        # History: one round reached with different states by different quorums (a fork: the
        # run's state was lost, every worker holding it left, and the run went on from older).
        by_round: dict[int, dict[tuple[str | None, str | None], set[str]]] = {}
        for w in self.workers:
            if not w.honest:  # its state is whatever it made of it; the run's must not follow
                continue
            for t, r, model_crc, state, qid in w.syncs:
                key = qid or f"?{w.name}@{t}"
                crc, state = compared(model_crc, state, self.cfg["fragments"])
                by_quorum.setdefault(key, {}).setdefault((r, crc, state), []).append(w.name)
                by_round.setdefault(r, {}).setdefault((crc, state), set()).add(key)
        diverged = {
            qid: [
                {"round": r, "crc": c, "state": st, "workers": ws} for (r, c, st), ws in v.items()
            ]
            for qid, v in by_quorum.items()
            if len(v) > 1
        }
        forks = {
            r: [{"crc": c, "state": st, "quorums": sorted(qs)} for (c, st), qs in v.items()]
            for r, v in sorted(by_round.items())
            if len(v) > 1
        }
        finals = [w.final for w in self.workers if w.final is not None and w.honest]
        evals = [f for f in finals if f.get("eval_loss") is not None]
        best = max(evals, key=lambda f: f["round"]) if evals else None
        max_round = max((r for r in by_round), default=0)
        status_completed = sum(
            st.get("rounds_completed", 0) for st in self.server.last_status.values()
        )
        status_discarded = sum(
            st.get("rounds_discarded", 0) for st in self.server.last_status.values()
        )
        worker_rows = [
            {
                "worker": w.name,
                "slot": w.slot,
                "joiner": w.joiner,
                "killed": w.killed,
                "syncs": len(w.syncs),
                "first_round": w.syncs[0][1] if w.syncs else None,
                "last_round": w.syncs[-1][1] if w.syncs else None,
                "longest_stall_s": round(w.longest_stall, 1),
                "join_s": round(w.joined_at - w.started, 1) if w.joined_at else None,
                "final": w.final,
            }
            for w in self.workers
            if w.honest
        ]
        c = self.cfg
        return {
            "config": c,
            "rounds_completed": self.server.completed,
            "rounds_completed_status": status_completed,
            "rounds_discarded": self.server.discarded,
            "rounds_discarded_status": status_discarded,
            "discard_reasons": self.server.discard_reasons,
            "quorum_sizes": dict(sorted(self.server.formed_sizes.items())),
            "restart_early_quorums": len(self.server.early),
            "restart_early_rounds": self.server.early_rounds,
            "restart_early_detail": self.server.early,
            "max_round": max_round,
            "rounds_seen_by_workers": len(by_round),
            "server_lives": self.server.starts,
            **self.counts,
            "hang_limit_s": self.hang_limit,
            "worker_crashes": self.crashes,
            "worker_sources": sorted(self.sources),
            "hangs": self.hangs,
            "longest_stall_s": round(max((w.longest_stall for w in self.workers), default=0), 1),
            "server_longest_silence_s": round(self.server_longest_silence, 1),
            "diverged_quorums": diverged,
            "forked_rounds": forks,
            "majority_differs": self.server.majority_differs,
            "final_eval_loss": best["eval_loss"] if best else None,
            "final_eval_round": best["round"] if best else None,
            "final_eval_losses": sorted({round(f["eval_loss"], 6) for f in evals}),
            "worker_discarded_rounds": sum(
                int(f["metrics"].get("discarded_rounds", 0)) for f in finals
            ),
            "adversary": self.adversary_summary(),
            "wall_s": self.now(),
            "workers_detail": worker_rows,
            "events": self.events,
        }

    def adversary_summary(self) -> dict[str, Any]:
        """What the faulty party did and what it cost the honest workers: their finals finite,
        the rounds they completed after its first fault, and (``commit-death``) how long the
        survivors waited from its death to their next completed round."""
        c = self.cfg
        bad = [w for w in self.workers if not w.honest]
        honest_finals = [w.final for w in self.workers if w.honest and w.final is not None]
        first_fault = min((f["t"] for w in bad for f in w.faults), default=self.stranger_since)
        honest_syncs = sorted(t for w in self.workers if w.honest for t, *_ in w.syncs)
        after = [t for t in honest_syncs if first_fault is not None and t > first_fault]
        return {
            "kind": c["adversary"],
            "fault_step": c["fault_step"],
            "faults": [f for w in bad for f in w.faults],
            "bad_syncs": sum(len(w.syncs) for w in bad),
            "bad_exits": self.adversary_exits,
            "honest_finals_finite": all(
                f.get("eval_loss") is None or math.isfinite(f["eval_loss"]) for f in honest_finals
            ),
            "honest_syncs_after_first_fault": len(after),
            "wait_after_first_fault_s": round(after[0] - first_fault, 2)
            if after and first_fault is not None
            else None,
            "stranger": self.stranger,
            "server_defences": dict(self.server.defences),
            "last_status": self.server.last_status.get(self.server.starts, {}).get("quorum"),
        }
