"""Chaos run of the all-reduce mode (issue 19): kill -9 workers and the server while the workers
average among themselves, and check that no worker hangs and no replicas diverge.

    python benchmarks/chaos_allreduce.py --workers 4 --duration 300 --seed 0 \\
        --txt benchmarks/results/chaos_allreduce_seed0.txt \\
        --json benchmarks/results/chaos_allreduce_seed0.json

A ``diloco server --allreduce`` child on a fixed port (a restart keeps the address) and
``--workers`` worker children training the demo model (``benchmarks/chaos.py``'s loop) with a
small ``--sync-every``. A seeded, clock-driven schedule then, every ``--fault-min`` to
``--fault-max`` seconds, either kills the server with SIGKILL and starts it again on the same
port (``--server-share`` of the faults), or kills a random worker with SIGKILL and starts a
replacement for its data shard, under a fresh worker id (a joiner, ``--fresh-share`` of them)
or under the same id. Faults stop ``--settle`` seconds before the end, then every worker is
asked to stop at its next completed sync, evaluates the run's parameters and leaves.

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

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LISTENING = re.compile(r"diloco server listening on 127\.0\.0\.1:(\d+)")
COMPLETED = re.compile(r"quorum (\S+) completed: round (\d+)")
FORMED = re.compile(r"quorum (\S+) formed: (.*) at round (\d+)")
REGISTERED = re.compile(r"worker (\S+) (?:re-)?registered from")
DISCARDED = re.compile(r"quorum (\S+) \(round (\d+)\) discarded: (.*)")
MAJORITY_DIFFERS = "ended with another state than the majority's"


# --- the worker process --------------------------------------------------------------------------


class SyncWatch:
    """Whether the inner step just taken completed a sync: the moment the worker reports its
    round and state, which the members of the quorum that completed it must share.

    Plain (``streaming`` False): ``local_step == 0`` after ``opt.step()``; the model then holds
    the run's parameters. Streaming: ``local_step`` is the schedule's phase and a round completes
    on the round's thread, so a sync is a round completed since the last one reported
    (``sync_metrics["rounds"]`` grew) with none in flight: its fragment is merged, and the
    round's thread, the only writer of the state while a round runs, has ended. A round is in
    flight for ``--overlap`` of the ``sync_every / P`` steps between two rounds (the driver
    keeps tau below that), so the check sees every completed round one step after its merge."""

    def __init__(self, worker: Any, streaming: bool) -> None:
        self.worker, self.streaming = worker, streaming
        self.rounds = int(worker.sync_metrics["rounds"])  # joining completes none

    def __call__(self) -> bool:
        if not self.streaming:
            return bool(self.worker.local_step == 0)
        if getattr(self.worker._strategy, "_inflight", None) is not None:
            return False
        rounds = int(self.worker.sync_metrics["rounds"])
        done, self.rounds = rounds > self.rounds, rounds
        return done


def worker_main(args: argparse.Namespace) -> int:
    """One worker: trains the demo model on its shard until stdin closes, then stops at its
    next completed sync (``--final-wait`` at most), evaluates and leaves. Prints JSON lines."""
    import logging

    import torch

    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, evaluate, loss_on
    from diloco.wire.checksum import tensor_checksum
    from diloco.worker import DiLoCoClient, DiLoCoWorker

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's stack dump
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)

    def say(**event: Any) -> None:
        print(json.dumps(event), flush=True)

    corpus = build_corpus(args.shards)
    tokens = corpus.shards[args.shard]
    model = build_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + args.incarnation)
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # EOF: the driver asks this worker to stop
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    import diloco

    say(event="started", pid=os.getpid(), source=diloco.__file__)

    class RecordingClient(DiLoCoClient):
        """Remembers the last quorum the server handed out: the one a completed sync ran."""

        last: tuple[str, list[str]] | None = None

        def quorum(self, worker_id: str, *, round: int, hash: str) -> dict[str, Any]:
            reply = super().quorum(worker_id, round=round, hash=hash)
            if "quorum_id" in reply:
                self.last = (reply["quorum_id"], list(reply["members"]))
            return reply

    client = RecordingClient(args.address, retries=8, backoff=0.2, max_backoff=2.0, read_timeout=30)
    worker = DiLoCoWorker(
        model,
        opt,
        args.address,
        sync_every=args.sync_every,
        worker_id=args.worker_id,
        heartbeat_interval=1.0,
        client=client,
        num_fragments=args.fragments,
        overlap_steps=args.overlap,
        merge_alpha=args.alpha,
    )

    def state_hash() -> str | None:
        strategy = getattr(worker, "_strategy", None)  # AllReduceSync's hash of its state
        return getattr(strategy, "_hash", None)

    stopping_since: float | None = None
    final: dict[str, Any] = {}
    with worker:
        synced = SyncWatch(worker, streaming=args.fragments > 1)
        say(
            event="joined",
            round=worker.base_round,
            crc=tensor_checksum(model.parameters()),
            state=state_hash(),
            quorum=client.last and client.last[0],
        )
        while True:
            x, y = sample_batch(tokens, 16, 64, gen)
            loss = loss_on(model, x, y)
            loss.backward()
            opt.step()  # the worker's hook runs the sync every sync_every steps
            opt.zero_grad()
            if synced():
                say(
                    event="sync",
                    round=worker.base_round,
                    crc=tensor_checksum(model.parameters()),
                    state=state_hash(),
                    quorum=client.last and client.last[0],
                    members=client.last and client.last[1],
                )
                if stop.is_set():
                    final = {"eval_loss": evaluate(model, corpus.eval), "at_sync": True}
                    break
            if stop.is_set():
                stopping_since = stopping_since or time.monotonic()
                if time.monotonic() - stopping_since > args.final_wait:
                    final = {"eval_loss": None, "at_sync": False}
                    break
        metrics = worker.sync_metrics
    say(
        event="final",
        round=worker.base_round,
        crc=tensor_checksum(model.parameters()),
        state=state_hash(),
        **final,
        metrics={k: v for k, v in metrics.items() if isinstance(v, int | float)},
    )
    return 0


# --- the driver ----------------------------------------------------------------------------------


def snapshot_source(dest: Path, tries: int = 10) -> dict[str, Any]:
    """Copy ``src/diloco`` to ``dest/diloco`` and check that it imports: the children run from
    this copy (``PYTHONPATH``), so edits to the working tree during a run cannot reach them."""
    src = Path(__file__).resolve().parent.parent / "src" / "diloco"
    check = "import diloco, diloco.server.server, diloco.worker.allreduce, diloco.demo.data"
    for _ in range(tries):
        shutil.rmtree(dest / "diloco", ignore_errors=True)
        shutil.copytree(src, dest / "diloco", ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(dest)}
        ok = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True)
        if ok.returncode == 0:
            digest = hashlib.sha256()
            for f in sorted((dest / "diloco").rglob("*.py")):
                digest.update(str(f.relative_to(dest)).encode() + f.read_bytes())
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True
            ).stdout.strip()
            return {"source_sha256": digest.hexdigest()[:16], "git_head": head}
        time.sleep(5)  # someone is editing the tree: try again
    raise RuntimeError(f"the source does not import: {ok.stderr.decode()[-2000:]}")


def compared(crc: str | None, state: str | None, fragments: int) -> tuple[str | None, str | None]:
    """What the members of one completed quorum must share, and what tells one round's states
    apart: the model's CRC and the state's hash; with streaming fragments the state's hash alone
    (the models differ by design, each keeping its progress on the fragments not just merged)."""
    return (crc if fragments == 1 else None), state


def short_reason(reason: str) -> str:
    """A discard reason without worker and quorum ids, cut: reasons of one kind count together."""
    reason = re.sub(r"quorum \S+: ", "", reason)
    return re.sub(r"\bw\d+\b", "W", reason)[:60].rstrip()


class Server:
    """``diloco server --allreduce`` as a child process that can be killed and restarted on its
    port. Counts the quorums each life completed and discarded from its log."""

    def __init__(self, cfg: dict[str, Any], log: Path) -> None:
        self.cfg, self.log = cfg, log
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0
        self.completed = 0
        self.discarded = 0
        self.majority_differs: list[str] = []
        self.discard_reasons: dict[str, int] = {}
        self.formed_sizes: dict[int, int] = {}  # quorums formed, by their number of members
        self.formed: dict[str, tuple[int, bool]] = {}  # id: start round, formed early
        self.registered: dict[int, set[str]] = {}  # per life
        # A restarted life's quorums formed before as many workers registered as were running
        # when it started (``expected``, set by the driver): the others were still away.
        self.expected: dict[int, int] = {}
        self.early: list[dict[str, Any]] = []
        self.early_rounds = 0
        self.last_status: dict[int, dict[str, Any]] = {}  # per life
        self._lock = threading.Lock()

    def start(self) -> None:
        c = self.cfg
        args = [
            *[sys.executable, "-m", "diloco", "server", "--allreduce"],
            *["--port", str(self.port), "--num-workers", str(c["workers"])],
            *["--heartbeat-timeout", str(c["heartbeat_timeout"])],
            *["--poll-timeout", str(c["poll_timeout"])],
            *["--collective-timeout", str(c["collective_timeout"])],
            *["--join-timeout", str(c["join_timeout"])],
        ]
        if c["fragments"] > 1:
            args += ["--num-fragments", str(c["fragments"])]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=c["env"]
        )
        self.starts += 1
        life = self.starts
        self.expected.setdefault(life, 0)
        found = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stderr is not None
            with open(self.log, "a") as fh:
                fh.write(f"===== server life {life} (pid {proc.pid}) =====\n")
                for line in proc.stderr:
                    fh.write(line)
                    fh.flush()
                    self._scan(line, life)
                    m = LISTENING.search(line)
                    if m and not found.is_set():
                        self.port = int(m.group(1))
                        found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(120):
            raise RuntimeError(f"server did not start; see {self.log}")

    def _scan(self, line: str, life: int) -> None:
        with self._lock:
            if m := REGISTERED.search(line):
                self.registered.setdefault(life, set()).add(m.group(1))
            elif m := FORMED.search(line):
                members = m.group(2).split(", ")
                self.formed_sizes[len(members)] = self.formed_sizes.get(len(members), 0) + 1
                early = life > 1 and len(self.registered.get(life, ())) < self.expected[life]
                self.formed[m.group(1)] = (int(m.group(3)), early)
                if early:
                    self.early.append(
                        {
                            "life": life,
                            "quorum": m.group(1),
                            "members": members,
                            "round": int(m.group(3)),
                            "registered": len(self.registered[life]),
                            "live_workers": self.expected[life],
                        }
                    )
            elif m := COMPLETED.search(line):
                start, early = self.formed.get(m.group(1), (None, False))
                if start is None or int(m.group(2)) > start:  # a join round takes no step
                    self.completed += 1
                    self.early_rounds += early
            elif m := DISCARDED.search(line):
                self.discarded += 1
                reason = short_reason(m.group(3))
                self.discard_reasons[reason] = self.discard_reasons.get(reason, 0) + 1
            if MAJORITY_DIFFERS in line:
                self.majority_differs.append(line.strip())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://{self.address}/status", timeout=timeout) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


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
        self.sources: set[str] = set()  # where the workers imported diloco from
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    # --- workers ----------------------------------------------------------------------------

    def start_worker(self, slot: int, worker_id: str, joiner: bool) -> Worker:
        c = self.cfg
        incarnation = sum(w.slot == slot for w in self.workers)
        log = self.logs / f"worker_slot{slot}_{worker_id}_{incarnation}.log"
        args = [
            *[sys.executable, __file__, "worker", "--address", self.server.address],
            *["--worker-id", worker_id, "--shard", str(slot), "--shards", str(c["workers"])],
            *["--seed", str(c["seed"]), "--incarnation", str(slot * 1000 + incarnation)],
            *["--sync-every", str(c["sync_every"]), "--lr", str(c["lr"])],
            *["--final-wait", str(c["final_wait"])],
            *["--fragments", str(c["fragments"]), "--overlap", str(c["overlap"])],
            *["--alpha", str(c["alpha"])],
        ]
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 (the child owns it)
            text=True,
            env=c["env"],
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

    def _progress(self, w: Worker, t: float, round_: int) -> None:
        stall = t - w.last_progress
        if stall > w.longest_stall:
            w.longest_stall, w.longest_stall_end_round = stall, round_
        w.last_progress = t

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None and not w.killed]

    def check_stalls(self) -> None:
        """A live worker without a completed sync for longer than the hang limit: dump its
        stacks (once per stall) and record it."""
        t = time.monotonic()
        with self.lock:
            for w in self.live():
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

    def aim(self) -> tuple[bool, float]:
        """Whether this kill waits for an open quorum, and the delay after it opens."""
        aimed = self.rng.random() < self.cfg["aim_share"]
        return aimed, self.rng.uniform(0.0, self.cfg["aim_delay"])

    def kill_worker(self) -> None:
        live = self.live()
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
        self.server.expected[self.server.starts + 1] = len(self.live())
        self.server.start()
        self.server_unanswered_since = None

    def note(self, kind: str, **info: Any) -> None:
        ev = {"t": self.now(), "event": kind, **info}
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
        end_faults = self.t0 + c["duration"] - c["settle"]
        end = self.t0 + c["duration"]
        next_fault = self.t0 + c["first_fault"]
        next_poll = 0.0
        try:
            while time.monotonic() < end:
                time.sleep(0.2)
                t = time.monotonic()
                if t >= next_poll:
                    self.poll_server()
                    next_poll = t + 1.0
                self.check_stalls()
                for w in self.workers:
                    if not w.killed and not w.exited and w.proc.poll() is not None:
                        w.exited = True  # nothing asked it to leave: a crash
                        self.crashes.append({"worker": w.name, "rc": w.proc.returncode})
                        self.note("worker_exited", worker=w.name, rc=w.proc.returncode)
                if c["chaos"] and t >= next_fault and t < end_faults:
                    if self.rng.random() < c["server_share"]:
                        self.kill_server()
                    else:
                        self.kill_worker()
                    next_fault = time.monotonic() + self.rng.uniform(c["fault_min"], c["fault_max"])
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
            for w in self.workers:
                if w.proc.poll() is None:
                    w.proc.kill()
            self.server.stop()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        # Replicas: the members of one completed quorum must hold the same state after it.
        by_quorum: dict[str, dict[tuple[int, str, str | None], list[str]]] = {}
        # History: one round reached with different states by different quorums (a fork: the
        # run's state was lost, every worker holding it left, and the run went on from older).
        by_round: dict[int, dict[tuple[str, str | None], set[str]]] = {}
        for w in self.workers:
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
        finals = [w.final for w in self.workers if w.final is not None]
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
            "wall_s": self.now(),
            "workers_detail": worker_rows,
            "events": self.events,
        }


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
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        cell = f"{v:.4f}" if isinstance(v, float) else str(v)
        lines.append(f"{k:<{width}}  {cell:>10}")
    sizes = {int(k): v for k, v in res["quorum_sizes"].items()}  # JSON made the keys strings
    lines += ["", f"quorums formed, by members: {sizes}"]
    lines += ["discard reasons (server log):"]
    reasons: dict[str, int] = {}
    for reason, n in res["discard_reasons"].items():
        reasons[short_reason(reason)] = reasons.get(short_reason(reason), 0) + n
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:>4}  {reason}")
    lines += [
        "",
        f"{'worker':<10}{'joiner':>7}{'killed':>7}{'syncs':>7}{'rounds':>12}"
        f"{'join_s':>8}{'stall_s':>9}",
    ]
    for w in res["workers_detail"]:
        span = f"{w['first_round']}-{w['last_round']}" if w["syncs"] else "-"
        lines.append(
            f"{w['worker']:<10}{'yes' if w['joiner'] else '':>7}"
            f"{'yes' if w['killed'] else '':>7}{w['syncs']:>7}{span:>12}"
            f"{w['join_s'] if w['join_s'] is not None else '-':>8}{w['longest_stall_s']:>9}"
        )
    if res["hangs"]:
        lines += ["", "HANGS:", *(json.dumps(h) for h in res["hangs"])]
    if res["diverged_quorums"]:
        lines += ["", "DIVERGED:", *(f"{q}: {v}" for q, v in res["diverged_quorums"].items())]
    if res["forked_rounds"]:
        lines += ["", "FORKED:", *(f"round {r}: {v}" for r, v in res["forked_rounds"].items())]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser()
        p.add_argument("worker")
        for name in ("--address", "--worker-id"):
            p.add_argument(name, required=True)
        for name in ("--shard", "--shards", "--seed", "--incarnation", "--sync-every"):
            p.add_argument(name, type=int, required=True)
        p.add_argument("--lr", type=float, default=3e-3)
        p.add_argument("--final-wait", type=float, default=60.0)
        p.add_argument("--fragments", type=int, default=1)
        p.add_argument("--overlap", type=int, default=0)
        p.add_argument("--alpha", type=float, default=0.5)
        return worker_main(p.parse_args())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of training")
    parser.add_argument("--settle", type=float, default=30.0, help="fault-free seconds at the end")
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-min", type=float, default=5.0)
    parser.add_argument("--fault-max", type=float, default=15.0)
    parser.add_argument("--first-fault", type=float, default=20.0, help="seconds before the first")
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
    parser.add_argument("--logs", help="folder for the logs (default: a temporary one)")
    parser.add_argument("--json")
    parser.add_argument("--txt")
    args = parser.parse_args()
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
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    bad = res["hangs"] or res["worker_crashes"] or res["diverged_quorums"] or res["forked_rounds"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
