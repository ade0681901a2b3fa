"""The worker processes of a chaos_allreduce run: starting them (a joiner, a restart under the
same id, the faulty worker), reading the events each prints (joined, sync, final, fault) into the
run's ``Record``, and watching for a live worker that completes no sync past the hang limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.faults.chaos_allreduce_record import Record, Worker
from benchmarks.faults.chaos_allreduce_server import Server
from benchmarks.harness.source import ROOT


class Fleet(Record):
    """Starts and watches the workers; ``Run`` adds the server, the faults and the loop."""

    def __init__(self, cfg: dict[str, Any], logs: Path, server: Server) -> None:
        self.logs = logs
        self.lock = threading.Lock()
        super().__init__(cfg, server)

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
