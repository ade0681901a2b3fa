"""A session: one hub process and N member processes, driven one round at a time.

The hub is a spawned child that sends a hello (a dict with at least its ``pid``) on its pipe
and then answers commands on it: a diloco server (``server_child.server_main``: ``"status"``,
``"stop"``), torchft's lighthouse, or the raw-socket server (``loopback``). The members are
spawned children called as ``target(index, queue, *args)``: they report ``("ready", i, ...)`` on the queue, then per round
``("prepared", i, ...)`` (idle at the start barrier from then on) and ``("round", i, ...)``,
and at last ``("done", i, ...)``; a failure is ``("error", i, text)``, which the parent raises
at once. A round: the parent's arrival at the start barrier (N members + the parent) starts it,
and the parent reads the hub's CPU time around it (``processes.start_and_collect``). A second
barrier, of the members alone (``finished``), lets a member that is done wait for the others
before its own bookkeeping, so that nothing of it competes for the cores with a sync still in
progress; it is held here for the whole session (a multiprocessing barrier the parent drops is
torn down).

Every child's RSS is polled from here (``rss.RssPoller``; not for the raw-socket limit), and
whatever still runs at the end, on an error too, is terminated, then killed (``processes.reap``).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from benchmarks.harness.processes import Environ, Inbox, check_alive, reap, start_and_collect
from benchmarks.harness.rss import RssPoller


class Session:
    """The processes of one configuration's run (see the module docstring). A context manager:
    RSS polling runs while it is open, and every child is reaped when it closes."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        *,
        total_rounds: int,
        setup_timeout: float,
        round_timeout: float,
        poll_rss: bool = True,
    ) -> None:
        self.ctx, self.n, self.total_rounds = ctx, n, total_rounds
        self.setup_timeout, self.round_timeout = setup_timeout, round_timeout
        self.procs: list[Any] = []
        self.members: list[Any] = []
        #: Polled only with ``poll_rss``: a run that measures a ceiling of the machine (the
        #: raw-socket limit) keeps the parent's polling thread off its cores.
        self.poller = RssPoller()
        self._poll_rss = poll_rss
        self.hub_conn: Any = None
        self.rounds_started = 0
        self._prepared = -1  # the last round for which every member said it is prepared

    def __enter__(self) -> Session:
        if self._poll_rss:
            self.poller.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._poll_rss:
            self.poller.__exit__()
        reap(self.procs)

    # --- starting --------------------------------------------------------------------------

    def start_hub(
        self, target: Callable[..., None], args: tuple[Any, ...], name: str, env: Any = None
    ) -> dict[str, Any]:
        """Spawn the hub as ``target(pipe_end, *args)`` (with ``env``, ``KEY=VALUE`` strings, in
        its environment only) and wait for its hello, failing at once if it dies first."""
        self.hub_conn, child = self.ctx.Pipe()
        self.hub = self.ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.procs.append(self.hub)
        with Environ(env):
            self.hub.start()
        deadline = time.monotonic() + self.setup_timeout
        while not self.hub_conn.poll(1.0):
            if not self.hub.is_alive():
                raise RuntimeError(f"the {name} process died ({self.hub.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {name} process did not say hello")
        self.hello: dict[str, Any] = self.hub_conn.recv()
        self.poller.watch(self.hello["pid"])
        self.hub_proc = psutil.Process(self.hello["pid"])
        return self.hello

    def start_members(
        self, target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]], prefix: str
    ) -> dict[int, Any]:
        """Make the barriers and the inbox, spawn member i as ``target(i, queue, *args_of(i))``
        (named ``prefix-i``; ``args_of`` may pass ``self.barrier`` and ``self.finished``), and
        wait for every member's "ready": their payloads, by index."""
        n = self.n
        self.barrier = self.ctx.Barrier(n + 1)  # the members, and the parent
        self.finished = self.ctx.Barrier(n)
        self.inbox = Inbox(self.ctx.Queue())
        self.members = [
            self.ctx.Process(
                target=target,
                args=(i, self.inbox.q, *args_of(i)),
                name=f"{prefix}-{i}",
                daemon=True,
            )
            for i in range(n)
        ]
        self.procs.extend(self.members)
        for m in self.members:
            m.start()
            self.poller.watch(m.pid)
        self.ready: dict[int, Any] = self.inbox.collect(
            "ready", n, self.setup_timeout, f"N={n} {prefix} setup"
        )
        return self.ready

    # --- the hub -----------------------------------------------------------------------------

    def call_hub(self, cmd: str, timeout: float = 60.0) -> Any:
        """Send ``cmd`` to the hub and return its answer."""
        self.hub_conn.send(cmd)
        if not self.hub_conn.poll(timeout):
            raise TimeoutError(f"the hub did not answer {cmd!r}")
        return self.hub_conn.recv()

    def tell_hub(self, cmd: str) -> None:
        """Send ``cmd`` to the hub, if it is still there to hear it; expect no answer."""
        if self.hub_conn is not None:
            try:
                self.hub_conn.send(cmd)
            except OSError:
                pass

    def stop_hub(self) -> dict[str, Any]:
        """``"stop"``: the hub's last word (a server's last status and peak RSS)."""
        final: dict[str, Any] = self.call_hub("stop")
        self.hub.join(30)
        return final

    # --- rounds ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until every member has done its between-round work and sits idle at the start
        barrier. After the last round there is no next one to prepare."""
        r = self.rounds_started
        if self._prepared < r < self.total_rounds:
            self.inbox.collect("prepared", self.n, self.round_timeout, f"N={self.n} round {r}")
            self._prepared = r

    def check(self, what: str) -> None:
        """Fail fast if a child died (it would show up only as a barrier timeout)."""
        check_alive(self.procs, what)

    def start_round(self, what: str) -> tuple[dict[int, Any], dict[str, float]]:
        """Release the members into a round (once they are prepared) and collect their reports,
        with the round's CPU seconds: the hub's, and the members' together."""
        self.check(what)
        self.settle()
        return self.run_round(what)

    def run_round(self, what: str) -> tuple[dict[int, Any], dict[str, float]]:
        """The round itself, for a caller that has settled and read what it reads before."""
        msgs, cpu = start_and_collect(
            self.barrier, self.inbox, self.hub_proc, self.n, self.round_timeout, what
        )
        self.rounds_started += 1
        return msgs, cpu

    def finish_members(self, what: str) -> dict[int, Any]:
        """Every member's "done" payload, by index."""
        return self.inbox.collect("done", self.n, self.setup_timeout, f"N={self.n} {what}")

    def join_members(self) -> None:
        for m in self.members:
            m.join(30)

    def member_memory(self, done: dict[int, Any]) -> dict[str, Any]:
        """The members' memory: the highest ``ru_maxrss`` (and each one's), the polled peak,
        and the RSS after importing torch and diloco and after joining."""
        return {
            "maxrss": max(d["maxrss"] for d in done.values()),
            "maxrss_each": [done[i]["maxrss"] for i in sorted(done)],
            "polled_peak_rss": max(
                (self.poller.peaks.get(m.pid, 0) for m in self.members), default=0
            ),
            "base_rss": max(r["base_rss"] for r in self.ready.values()),
            "rss_after_join": max(r["rss_joined"] for r in self.ready.values()),
        }


def run_member(body: Callable[..., None], idx: int, out: Any, *rest: Any) -> None:
    """A member child's entry: ``body(idx, out, *rest)``, whose failure reaches the parent's
    inbox at once (with its traceback) instead of as a barrier timeout minutes later."""
    try:
        body(idx, out, *rest)
    except BaseException as exc:
        import traceback

        out.put(("error", idx, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


class SessionRun:
    """A benchmark's run of one configuration over a ``Session``: the session opens with the run
    and closes with it, on an error in ``_start`` too. ``args`` carries ``setup_timeout`` (15 s
    more per member are allowed) and ``round_timeout``. A subclass starts its hub and members
    in ``_start``; ``kill`` (a kill run's settings) reaches member ``i`` through ``kill_of``."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        args: Any,
        *,
        rounds: int,
        kill: dict[str, Any] | None = None,
    ) -> None:
        self.ctx, self.n, self.args, self.total_rounds, self.kill = ctx, n, args, rounds, kill
        self.setup_timeout = args.setup_timeout + 15 * n
        self.session = Session(
            ctx,
            n,
            total_rounds=rounds,
            setup_timeout=self.setup_timeout,
            round_timeout=args.round_timeout,
        )
        self.rounds: list[dict[str, Any]] = []
        if kill is not None:
            self.victim_conn, self._victim_end = ctx.Pipe(duplex=False)

    def __enter__(self) -> Any:
        self.session.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__()

    def _start(self) -> None:
        raise NotImplementedError

    def round(self) -> dict[str, Any]:
        """One round, recorded in ``rounds``."""
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """The run's figures, once its rounds are done."""
        raise NotImplementedError

    def measure(self) -> dict[str, Any]:
        """Every round the run was opened for, then its figures."""
        for _ in range(self.total_rounds):
            self.round()
        return self.finish()

    def kill_victim(self) -> Killed:
        """A kill run: wait until every member is inside the kill round's all-reduce (the
        victim, the last member, blocking there), SIGKILL the victim, and collect the
        survivors' "done"."""
        n, s = self.n, self.session
        wait = self.setup_timeout + self.args.round_timeout
        inside, late = wait_inside(s.inbox, self.victim_conn, n, wait)
        os.kill(s.members[-1].pid, signal.SIGKILL)
        t_kill = time.monotonic()
        done = s.inbox.collect("done", n - 1, wait, "the survivors after the kill")
        before = {str(i): t_kill - v["t"] for i, v in sorted(inside.items())}
        return Killed(t_kill, done, before, late)

    def pace_of(self, i: int) -> tuple[Any, ...]:
        """What member ``i`` takes last, after its own arguments: the rounds it runs, the start
        and finish barriers, how long it may wait at one (the first wait spans the setup), and
        its kill settings (``kill_of``)."""
        s = self.session
        wait = self.setup_timeout + self.args.round_timeout
        return (self.total_rounds, s.barrier, s.finished, wait, self.kill_of(i))

    def kill_of(self, i: int) -> dict[str, Any] | None:
        """Member ``i``'s kill settings: None outside a kill run; the last member is the victim,
        which says it is inside on a pipe of its own (``victim_conn``, ``wait_inside``)."""
        if self.kill is None:
            return None
        victim = i == self.n - 1
        return {**self.kill, "victim": victim, "conn": self._victim_end if victim else None}


@dataclass
class Killed:
    """What a kill run saw: when the victim was killed (``time.monotonic``), each survivor's
    "done" payload by index, how long before the kill each member said it was inside, and who
    did not say so in time."""

    t_kill: float
    done: dict[int, Any]
    inside_before_kill_s: dict[str, float]
    not_inside: list[str]

    @property
    def worker_maxrss(self) -> list[int]:
        """Each survivor's peak RSS, by index."""
        return [self.done[i]["maxrss"] for i in sorted(self.done)]

    def logs(self, more: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Each survivor's log of syncs, times in seconds after the kill: every entry's round,
        start and end, then what ``more(entry)`` adds."""
        t = self.t_kill
        return {
            str(i): [
                {"round": e["round"], "start": e["t0"] - t, "end": e["t1"] - t, **more(e)}
                for e in self.done[i]["log"]
            ]
            for i in sorted(self.done)
        }


def median_phases(phases: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each phase's median over the dicts (workers of a round, or rounds of a run); None when
    there are none, or one is missing (a stamp did not fire)."""
    known = [p for p in phases if p is not None]
    if not phases or len(known) < len(phases):
        return None
    return {k: statistics.median(p[k] for p in known) for k in known[0]}


def wait_inside(
    inbox: Inbox, victim_conn: Any, n: int, wait: float
) -> tuple[dict[int, Any], list[str]]:
    """A kill run: the victim (member n-1) says on a pipe of its own that it is inside the kill
    round's all-reduce (a SIGKILL may catch it holding the lock of the shared queue), then the
    survivors say so on the queue, up to the collective's own limit: who did, and who did not."""
    if not victim_conn.poll(wait):
        raise TimeoutError("the victim never reached the all-reduce")
    inside = {n - 1: victim_conn.recv()}
    late = []
    try:
        inside.update(inbox.collect("inside", n - 1, 30, "the survivors reaching the all-reduce"))
    except TimeoutError as exc:
        late.append(str(exc))
    return inside, late
