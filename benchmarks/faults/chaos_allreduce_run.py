"""The driver of chaos_allreduce: a server, worker processes, a seeded fault schedule, checks.

``Run.go`` starts the server and ``--workers`` worker programs, kills workers or the server on a
seeded schedule in training seconds, counted from the moment they all joined
(``chaos_allreduce_schedule.py``; some kills aimed at an open quorum), replaces killed workers,
watches for hangs and crashes, stops every worker at its next completed sync, and sums up
(``Run.summary``): the replicas of each completed quorum must hold one state, no round may be reached twice with
different states, no worker may stall past the hang limit.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.faults.chaos_adversary import BAD_WORKER, KINDS, Stranger
from benchmarks.faults.chaos_allreduce_schedule import FaultClock, plan
from benchmarks.faults.chaos_allreduce_server import Server
from benchmarks.harness.source import ROOT


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


class Run:
    def __init__(self, cfg: dict[str, Any], logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.server = Server(cfg, logs / "server.log")
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.rng = random.Random(cfg["seed"])
        self.events: list[dict[str, Any]] = []
        self.counts = {
            "worker_kills": 0,
            "server_kills": 0,
            "joiners": 0,
            "same_id_restarts": 0,
            "kills_in_quorum": 0,
        }
        self.next_id = cfg["workers"]
        c = cfg
        self.hang_limit = (
            c["heartbeat_timeout"] + 3 * c["collective_timeout"] + c["poll_timeout"]
        ) + c["stall_slack"]
        self.server_unanswered_since: float | None = None
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

    # --- workers ----------------------------------------------------------------------------

    def start_worker(
        self, slot: int, worker_id: str, joiner: bool, fault: str | None = None
    ) -> Worker:
        c = self.cfg
        incarnation = sum(w.slot == slot for w in self.workers)
        log = self.logs / f"worker_slot{slot}_{worker_id}_{incarnation}.log"
        shard = slot % c["workers"]  # the faulty worker trains on shard 0's data
        args = [
            *[sys.executable, "-m", "benchmarks.faults.chaos_allreduce", "worker"],
            *["--address", self.server.address, "--token", c["token"]],
            *["--worker-id", worker_id, "--shard", str(shard), "--shards", str(c["workers"])],
            *["--seed", str(c["seed"]), "--incarnation", str(slot * 1000 + incarnation)],
            *["--sync-every", str(c["sync_every"]), "--lr", str(c["lr"])],
            *["--final-wait", str(c["final_wait"])],
            *["--fragments", str(c["fragments"]), "--overlap", str(c["overlap"])],
            *["--alpha", str(c["alpha"])],
        ]
        if fault is not None:
            args += ["--fault", fault, "--fault-step", str(c["fault_step"])]
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 (the child owns it)
            text=True,
            env=c["env"],
            cwd=ROOT,
        )
        w = Worker(slot, worker_id, incarnation, joiner, proc, time.monotonic(), log)
        w.last_progress = w.started
        threading.Thread(target=self._pump, args=(w,), daemon=True).start()
        with self.lock:
            self.workers.append(w)
        return w

    def _pump(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        for line in w.proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            t = time.monotonic()
            with self.lock:
                if ev.get("event") == "started":
                    self.sources.add(str(ev.get("source")))
                elif ev.get("event") == "joined":
                    w.joined_at = t
                    self._progress(w, t, ev["round"])
                elif ev.get("event") == "sync":
                    w.syncs.append(
                        (self.now(), ev["round"], ev["crc"], ev.get("state"), ev.get("quorum"))
                    )
                    self._progress(w, t, ev["round"])
                elif ev.get("event") == "final":
                    w.final = ev
                elif ev.get("event") == "fault":
                    w.faults.append({"t": self.now(), **ev})
                    self.note(
                        "fault", worker=w.name, **{k: v for k, v in ev.items() if k != "event"}
                    )

    def _progress(self, w: Worker, t: float, round_: int) -> None:
        stall = t - w.last_progress
        if stall > w.longest_stall:
            w.longest_stall, w.longest_stall_end_round = stall, round_
        w.last_progress = t

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None and not w.killed]

    def live_honest(self) -> list[Worker]:
        return [w for w in self.live() if w.honest]

    def check_stalls(self) -> None:
        """A live worker without a completed sync for longer than the hang limit: dump its
        stacks (once per stall) and record it."""
        t = time.monotonic()
        with self.lock:
            for w in self.live_honest():  # a faulty worker may never sync, by design
                stall = t - w.last_progress
                if stall > w.longest_stall:
                    w.longest_stall, w.longest_stall_end_round = stall, None
                if stall > self.hang_limit and not w.dumped:
                    w.dumped = True
                    last = w.syncs[-1][1] if w.syncs else None
                    self.hangs.append(
                        {
                            "worker": w.name,
                            "pid": w.proc.pid,
                            "at_s": self.now(),
                            "stall_s": round(stall, 1),
                            "last_round": last,
                            "log": str(w.log),
                        }
                    )
                    self.note("hang", worker=w.name, stall_s=round(stall, 1), last_round=last)
                    os.kill(w.proc.pid, signal.SIGUSR1)
                if stall <= self.hang_limit:
                    w.dumped = False

    def wait_for_quorum(self, member: str | None) -> dict[str, Any] | None:
        """Poll ``/status`` until a quorum is open (with ``member`` in it, when given); the
        quorum, or None after ``--aim-wait`` seconds."""
        deadline = time.monotonic() + self.cfg["aim_wait"]
        while time.monotonic() < deadline:
            st = self.server.status(timeout=1.0)
            q = st.get("quorum") if st else None
            if q and (member is None or member in q.get("members", ())):
                return q
            time.sleep(0.005)
        return None

    def open_quorum(self) -> str | None:
        """The id of the quorum open at the server's last status (the driver knows it; a
        stranger is handed it, as if it had guessed right)."""
        st = self.server.last_status.get(self.server.starts, {})
        q = st.get("quorum")
        return str(q["id"]) if isinstance(q, dict) and "id" in q else None

    def aim(self) -> tuple[bool, float]:
        """Whether this kill waits for an open quorum, and the delay after it opens."""
        aimed = self.rng.random() < self.cfg["aim_share"]
        return aimed, self.rng.uniform(0.0, self.cfg["aim_delay"])

    def kill_worker(self) -> None:
        live = self.live_honest()
        if not live:
            return
        w = self.rng.choice(live)
        fresh = self.rng.random() < self.cfg["fresh_share"]
        delay = self.rng.uniform(0.0, 2.0)
        aimed, after = self.aim()
        q = self.wait_for_quorum(w.worker_id) if aimed else None
        if q is not None:
            time.sleep(after)
        w.killed = True
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        self.counts["worker_kills"] += 1
        self.counts["kills_in_quorum"] += q is not None
        if fresh:
            new_id = f"w{self.next_id}"
            self.next_id += 1
            self.counts["joiners"] += 1
        else:
            new_id = w.worker_id
            self.counts["same_id_restarts"] += 1
        self.note(
            "kill_worker",
            worker=w.name,
            last_round=w.syncs[-1][1] if w.syncs else None,
            aimed=aimed,
            quorum=q and q.get("id"),
            after_open_s=round(after, 3) if q else None,
            replacement=new_id,
            delay_s=round(delay, 2),
        )
        time.sleep(delay)
        self.start_worker(w.slot, new_id, joiner=fresh)

    def kill_server(self) -> None:
        delay = self.rng.uniform(0.5, 3.0)
        aimed, after = self.aim()
        q = self.wait_for_quorum(None) if aimed else None
        if q is not None:
            time.sleep(after)
        st = self.server.last_status.get(self.server.starts, {})
        self.server.kill9()
        self.counts["server_kills"] += 1
        self.counts["kills_in_quorum"] += q is not None
        self.note(
            "kill_server",
            round=st.get("round"),
            aimed=aimed,
            quorum=q and q.get("id"),
            after_open_s=round(after, 3) if q else None,
            down_s=round(delay, 2),
        )
        time.sleep(delay)
        self.server.expected[self.server.starts + 1] = len(self.live_honest())
        self.server.start()
        self.server_unanswered_since = None

    def note(self, what: str, /, **info: Any) -> None:
        ev = {"t": self.now(), "event": what, **info}
        self.events.append(ev)
        print(json.dumps(ev), file=sys.stderr, flush=True)

    def poll_server(self) -> None:
        st = self.server.status(timeout=2.0)
        t = time.monotonic()
        if st is not None:
            self.server.last_status[self.server.starts] = st
            if self.server_unanswered_since is not None:
                silence = t - self.server_unanswered_since
                self.server_longest_silence = max(self.server_longest_silence, silence)
            self.server_unanswered_since = None
        elif self.server.alive():
            self.server_unanswered_since = self.server_unanswered_since or t
            silence = t - self.server_unanswered_since
            if silence > self.hang_limit:
                self.hangs.append({"worker": "server", "at_s": self.now(), "stall_s": silence})
                self.note("server_hang", silence_s=round(silence, 1))
                self.server_unanswered_since = t

    # --- the run ----------------------------------------------------------------------------

    def go(self) -> dict[str, Any]:
        c = self.cfg
        self.server.start()
        for slot in range(c["workers"]):
            self.start_worker(slot, f"w{slot}", joiner=False)
        if c["adversary"] in KINDS:
            self.start_worker(c["workers"], BAD_WORKER, joiner=False, fault=c["adversary"])
        stranger = None
        if c["adversary"] == "stranger":
            stranger = Stranger(
                self.server.address,
                lambda: [w.proc.pid for w in self.live()],
                c["seed"],
                self.open_quorum,
            )
            stranger.start()
            self.stranger_since = self.now()
        first = [w for w in self.workers if w.honest]  # training begins once they joined
        faults = plan(
            c["seed"],
            c["first_fault"],
            c["fault_min"],
            c["fault_max"],
            c["duration"] - c["settle"],
            c["server_share"],
        )
        clock = FaultClock(faults if c["chaos"] else (), c["duration"], c["settle"])
        next_poll = 0.0
        try:
            while True:
                time.sleep(0.2)
                t = time.monotonic()
                # A worker stuck before joining stalls past the hang limit, and is reported.
                if all(w.joined_at or w.exited for w in first) or t - self.t0 > self.hang_limit:
                    if clock.began is None:
                        self.note("training_began", faults_planned=len(clock.pending))
                    clock.begin(t)
                if (end := clock.end()) is not None and t >= end:
                    break
                if t >= next_poll:
                    self.poll_server()
                    next_poll = t + 1.0
                self.check_stalls()
                for w in self.workers:
                    if not w.killed and not w.exited and w.proc.poll() is not None:
                        w.exited = True  # nothing asked it to leave: a crash
                        crash = {"worker": w.name, "rc": w.proc.returncode}
                        (self.crashes if w.honest else self.adversary_exits).append(crash)
                        self.note("worker_exited", worker=w.name, rc=w.proc.returncode)
                if (fault := clock.due(t)) is not None:
                    if fault.server:
                        self.kill_server()
                    else:
                        self.kill_worker()
                    clock.dealt_with(time.monotonic())
            self.note("stopping")
            self.poll_server()
            for w in self.live():
                assert w.proc.stdin is not None
                w.proc.stdin.close()
            deadline = time.monotonic() + c["final_wait"] + 60
            while self.live() and time.monotonic() < deadline:
                time.sleep(0.2)
                self.check_stalls()
                if time.monotonic() >= next_poll:
                    self.poll_server()
                    next_poll = time.monotonic() + 1.0
            for w in self.live():  # did not leave: a hang at the end
                self.hangs.append(
                    {
                        "worker": w.name,
                        "at_s": self.now(),
                        "stall_s": None,
                        "detail": "did not exit after stop",
                        "log": str(w.log),
                    }
                )
                os.kill(w.proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
                w.proc.kill()
            time.sleep(0.5)
            self.poll_server()
        finally:
            if stranger is not None:
                stranger.stop.set()
                self.stranger = dict(stranger.counts, accepted=stranger.accepted[:20])
            for w in self.workers:
                if w.proc.poll() is None:
                    w.proc.kill()
            self.server.stop()
        return self.summary()

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
