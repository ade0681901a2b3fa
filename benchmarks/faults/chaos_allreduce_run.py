"""The driver of chaos_allreduce: a server, worker processes, a seeded fault schedule, the loop.

``Run.go`` starts the server and ``--workers`` worker programs (``chaos_allreduce_fleet.py``),
kills workers or the server on a seeded schedule in training seconds, counted from the moment
they all joined (``chaos_allreduce_schedule.py``; some kills aimed at an open quorum), replaces
killed workers, watches for hangs and crashes, stops every worker at its next completed sync,
and sums up (``Record.summary``, ``chaos_allreduce_record.py``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks.faults.chaos_adversary import BAD_WORKER, KINDS, Stranger
from benchmarks.faults.chaos_allreduce_fleet import Fleet
from benchmarks.faults.chaos_allreduce_schedule import FaultClock, plan, victims
from benchmarks.faults.chaos_allreduce_server import Server


class Run(Fleet):
    """One run: the fault actions (a worker killed and replaced, the server killed and
    restarted) and the loop that deals them out."""

    def __init__(self, cfg: dict[str, Any], logs: Path) -> None:
        server = Server(cfg, logs / "server.log")
        self.rng = random.Random(cfg["seed"])
        self.next_id = cfg["workers"]
        self.server_unanswered_since: float | None = None
        super().__init__(cfg, logs, server)

    # --- faults -----------------------------------------------------------------------------

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
        # Only a kill the run can survive: one that leaves a live worker holding the model
        # (``victims``); else wait, up to the hang limit, for a replacement to catch up.
        deadline = time.monotonic() + self.hang_limit
        while not (live := victims(self.live_honest(), lambda w: bool(w.syncs))):
            if time.monotonic() >= deadline:
                self.note("kill_skipped", reason="no worker but the one holding the model")
                return
            time.sleep(0.2)
            self.check_stalls()
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
