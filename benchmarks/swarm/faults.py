"""Faults and joins in a running demo swarm: a body replica killed mid-step (its connections
reset), one frozen mid-step (the driver's call timeout decides), and a replica joining: how long
each takes, and the micro-batches lost (which must be none)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from benchmarks.harness.report import print_table
from benchmarks.swarm.demo_swarm import Setup, batches, swarm

WAIT = 60.0
REPLICAS = 3


class NthForward:
    """A hook for the replicas of stage 1 that holds the ``n``-th forward (counted over all of
    them once ``armed``) before its work, says which replica and when (``reached``), and lets it go when
    ``release``d."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.replica, self.at = n, 0, -1, 0.0
        self.armed = False  # counting starts once the warm steps are done
        self.reached, self.released = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def for_replica(self, r: int) -> Any:
        def hook(kind: str, call: str) -> None:
            if kind != "forward":
                return
            with self._lock:
                if not self.armed:
                    return
                self.seen += 1
                stop = self.seen == self.n
            if stop:
                self.replica, self.at = r, time.perf_counter()
                self.reached.set()
                self.released.wait(WAIT)

        return hook


def fault(args: Any, corpus: Any, kind: str) -> dict[str, Any]:
    """Three replicas of stage 1 (so that one slow call on this busy machine, a 503 ``late``,
    does not leave the stage empty before the fault); ``warm`` steps, then the step whose 2nd
    micro-batch forward meets the fault (``kill``: connections reset and the service stopped; ``freeze``: the call
    never returns), then one more step. Recovery: from the fault to the step's return."""
    setup = Setup(
        seed=args.seed,
        batch=args.batch,
        micro_batch=args.batch // 4,
        in_flight=1,
        codec="int8",
        timeout_floor_s=args.timeout_floor,
    )
    per_step, warm = 4, 3
    trap = NthForward(2)
    hooks = {(1, r): trap.for_replica(r) for r in range(REPLICAS)}
    data = batches(corpus.shards[0], warm + 2, args.batch, args.seed)
    with swarm(setup, replicas={1: REPLICAS}, hooks=hooks) as s:
        driver = s.head.driver
        assert driver is not None
        step_s = []
        for x, y in data[:warm]:
            t0 = time.perf_counter()
            s.head.train_step(x, y)
            step_s.append(time.perf_counter() - t0)
        timeout = driver.picker.timeout(1)
        trap.armed = True
        if kind == "kill":

            def kill() -> None:
                if trap.reached.wait(WAIT):
                    victim = s.stages[1][trap.replica]
                    assert victim.service is not None
                    victim.service.stop(abrupt=True)
                    trap.released.set()

            killer = threading.Thread(target=kill)
            killer.start()
        try:
            s.head.train_step(*data[warm])
            done = time.perf_counter()
            if kind == "kill":
                killer.join(WAIT)
            s.head.train_step(*data[warm + 1])
            others = [p for r, p in enumerate(s.stages[1]) if r != trap.replica]
            for p in [*others, s.stages[2][0]]:
                assert p.service is not None
                p.service.drain()
            body_steps = sum(int(p.stats().get("steps", 0)) for p in s.stages[1])
            # The victim's partial step died with it: only the others' pending samples count.
            pending = sum(int(p.stats()["pending_samples"]) for p in others)
            tail = s.stages[2][0].stats()
            stats = driver.stats()
        finally:
            trap.released.set()
    total = warm + 2
    lost_body = (total * args.batch - body_steps * args.batch - pending) // setup.micro_batch
    lost_tail = (total - int(tail["steps"])) * per_step
    return {
        "fault": kind,
        "recovery_s": done - trap.at,
        "timeout_s": timeout,
        "normal_step_s": statistics.median(step_s),
        "lost": lost_body + lost_tail,
        "reroutes": stats["reroutes"],
        "recoveries": stats["recoveries"],
    }


def join(args: Any) -> dict[str, Any]:
    """A second stage-1 replica joins a running swarm: from its ``start()`` call, and from
    its ready, to the head's routes (the coordinator's table, long-polled) listing it."""
    setup = Setup(seed=args.seed, batch=args.batch)
    with swarm(setup) as s:
        routes = s.head.routes
        assert routes is not None
        t0 = time.perf_counter()
        s.add(1, setup)
        ready = time.perf_counter()
        seen = routes.wait(lambda: len(routes.endpoints(1)) == 2, WAIT)
        t1 = time.perf_counter()
    return {"seen": seen, "from_start_s": t1 - t0, "from_ready_s": t1 - ready}


def faults_table(kill: dict[str, Any], freeze: dict[str, Any], joined: dict[str, Any]) -> None:
    print_table(
        [
            "event",
            "recovered in (s)",
            "driver's call timeout (s)",
            "normal step (s)",
            "micro-batches lost",
            "re-sent calls",
            "replayed",
        ],
        [
            [
                f["fault"],
                f"{f['recovery_s']:.3f}",
                f"{f['timeout_s']:.2f}",
                f"{f['normal_step_s']:.3f}",
                str(f["lost"]),
                str(f["reroutes"]),
                str(f["recoveries"]),
            ]
            for f in (kill, freeze)
        ],
    )
    print_table(
        ["joiner in the head's routes", "from start() (s)", "from its ready (s)"],
        [[str(joined["seen"]), f"{joined['from_start_s']:.3f}", f"{joined['from_ready_s']:.3f}"]],
    )
