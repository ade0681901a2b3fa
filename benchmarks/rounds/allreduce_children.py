"""What runs inside allreduce_round's spawned workers.

The model is ``harness.model``'s (square bias-free ``nn.Linear`` layers, seed 0 on every worker,
so that all-reduce workers start from the same state and no broadcast happens at the start). The
server is ``harness.server_child``'s, in server mode (initial parameters from a safetensors file,
so no worker uploads them) or in all-reduce mode (no parameters; when a counting proxy stands in
front of its rendezvous store, the quorum replies name the proxy, so that the store traffic is
counted as well).

Workers (``worker_main``): a round is the sync-round benchmark's: perturb every weight a little
(standing in for H local steps), wait at a barrier with the parent, ``force_sync()``, wait for the
other workers, report. Around the library's calls, stamps of where the time goes (wrappers installed
on the worker's client and on module attributes of ``diloco.worker.allreduce``'s loop and payloads
in the child; the library's code is unchanged). ``kill`` mode: no barrier, the workers sync one
round after another; one victim blocks inside a chosen round's all-reduce until the parent kills it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from benchmarks.harness.model import ModelShape, build_model, checksum, noise_buffer, perturb
from benchmarks.harness.rss import base_rss, maxrss, rss
from benchmarks.harness.session import run_member
from benchmarks.rounds.sync_children import stamp_server_sync

# --- workers ---------------------------------------------------------------------------------


class Stamps:
    """Monotonic stamps of one sync, filled by the wrappers below (one worker, one thread)."""

    def __init__(self) -> None:
        self.d: dict[str, Any] = {}
        self.events: list[tuple[str, float]] = []  # every wrapped call's end, in order

    def clear(self) -> None:
        self.d = {}
        self.events = []

    def mark(self, what: str) -> None:
        t = time.monotonic()
        self.d.setdefault(what, t)  # the first of a sync
        self.events.append((what, t))


def instrument(worker: Any, stamps: Stamps, mode: str) -> None:
    """Stamp the phases of a sync. Server mode: the upload answered, the download body begun
    (as sync_round_children). All-reduce mode: the quorum reply, the group built, the average
    begun and done, the commit collective done, the outer step done, the outcome reported."""
    client = worker.client
    if mode == "server":
        stamp_server_sync(worker, stamps.mark)
        return

    import diloco.worker.allreduce.fragment_rounds as fragments
    import diloco.worker.allreduce.quorum_sync as ar
    import diloco.worker.allreduce.whole_model as whole

    quorum = client.quorum
    outcome = client.quorum_outcome

    def timed_quorum(*a: Any, **k: Any) -> Any:
        stamps.mark("quorum_asked")
        reply = quorum(*a, **k)
        stamps.mark("quorum_reply" if "quorum_id" in reply else "quorum_pending")
        return reply

    def timed_outcome(*a: Any, **k: Any) -> Any:
        reply = outcome(*a, **k)
        stamps.mark("reported" if k.get("ok") else "reported_failure")
        return reply

    client.quorum = timed_quorum
    client.quorum_outcome = timed_outcome
    if getattr(ar, "_bench_instrumented", False):
        return
    ar._bench_instrumented = True  # type: ignore[attr-defined]
    build = ar.QuorumCollective.build.__func__  # type: ignore[attr-defined]
    average, compare, outer = ar.checked_average, ar.compare, whole.apply_outer_step

    def timed_build(cls: Any, *a: Any, **k: Any) -> Any:
        group = build(cls, *a, **k)
        stamps.mark("group_built")
        return group

    def timed_average(*a: Any, **k: Any) -> Any:
        stamps.mark("average_start")
        total = average(*a, **k)
        stamps.mark("average_end")
        return total

    def timed_compare(*a: Any, **k: Any) -> Any:
        same = compare(*a, **k)
        stamps.mark("committed")
        return same

    def timed_outer(*a: Any, **k: Any) -> Any:
        outer(*a, **k)
        stamps.mark("outer_done")

    ar.QuorumCollective.build = classmethod(timed_build)  # type: ignore[method-assign,assignment]
    ar.checked_average = timed_average
    ar.compare = timed_compare
    whole.apply_outer_step = fragments.apply_outer_step = timed_outer  # the payloads' step


def phases(s: dict[str, float], t0: float, t1: float, mode: str) -> dict[str, float] | None:
    """One worker's sync split at its stamps (seconds); None if a stamp is missing."""
    try:
        if mode == "server":
            return {"upload_s": s["submitted"] - t0, "download_s": t1 - s["submitted"]}
        return {
            "quorum_wait_s": s["quorum_reply"] - t0,  # POST /quorum, until every worker asked
            "group_build_s": s["group_built"] - s["quorum_reply"],  # rendezvous, gloo pairs
            "pseudograd_s": s["average_start"] - s["group_built"],  # acc = snapshot - local
            "average_s": s["average_end"] - s["average_start"],  # checks + bucketed all-reduce
            "commit_check_s": s["committed"] - s["average_end"],  # hash of the average, compared
            "outer_step_s": s["outer_done"] - s["committed"],  # group closed, Nesterov step
            "adopt_hash_report_s": s["reported"] - s["outer_done"],  # adopt, state hash, POST
            "rest_s": t1 - s["reported"],
        }
    except KeyError:
        return None


def step_and_perturb(model: Any, optimizer: Any, noise: Any, gen: Any) -> None:
    """Stand-in for H local steps (``harness.model.perturb``), after one ``optimizer.step()``
    without gradients (it changes nothing) so that the worker counts a local step: an
    all-reduce worker with no step since its last sync contributes with weight 0, and a quorum
    whose weights are all 0 averages nothing."""
    optimizer.step()
    perturb(model, noise, gen)


def say_inside(out: Any, idx: int, kill: dict[str, Any]) -> None:
    """A worker reached the all-reduce of the kill round. The victim says so on a pipe of its
    own and blocks until it is killed: a SIGKILL may catch it holding the lock of what it wrote
    to, and the survivors still write to the shared queue."""
    if kill["victim"]:
        kill["conn"].send({"t": time.monotonic()})
        threading.Event().wait()  # until killed, never issuing the collective
    out.put(("inside", idx, {"t": time.monotonic()}))


def worker_main(idx: int, out: Any, *rest: Any) -> None:
    """A worker child (arguments as ``_worker_body``'s)."""
    run_member(_worker_body, idx, out, *rest)


def _worker_body(
    idx: int,
    out: Any,
    address: str,
    shape: ModelShape,
    mode: str,
    comm: str,
    total_rounds: int,
    barrier: Any,
    finished: Any,
    barrier_timeout: float,
    kill: dict[str, Any] | None = None,
) -> None:
    """``kill``: None for the round benchmark; else {"victim": bool, "round": r,
    "heartbeat_interval": s}: no barriers, rounds back to back, and at round r's first
    all-reduce every worker says so, the victim then blocking until it is killed."""
    import torch

    torch.set_num_threads(1)
    from diloco import DiLoCoWorker
    from diloco.worker.allreduce.collective import QuorumCollective

    base = base_rss()
    model = build_model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + idx)
    noise = noise_buffer(shape)
    stamps = Stamps()
    current = {"round": -1, "said": False}

    if kill is not None:
        original = QuorumCollective.collective

        def collective(self: Any, what: str, start: Any) -> None:
            if what == "all-reduce" and current["round"] == kill["round"] and not current["said"]:
                current["said"] = True
                say_inside(out, idx, kill)
            original(self, what, start)

        QuorumCollective.collective = collective  # type: ignore[method-assign]

    heartbeat = 0.0 if kill is None else float(kill["heartbeat_interval"])
    with DiLoCoWorker(
        model,
        optimizer,
        address,
        sync_every=10**9,
        codec=comm,
        worker_id=f"bench-{idx:02d}",
        heartbeat_interval=heartbeat,
    ) as worker:
        instrument(worker, stamps, mode)
        out.put(("ready", idx, {"base_rss": base, "rss_joined": rss(), "pid": os.getpid()}))
        log = []
        for r in range(total_rounds):
            step_and_perturb(model, optimizer, noise, gen)
            before = worker.sync_metrics
            if kill is None:
                out.put(("prepared", idx, {"round": r}))
                barrier.wait(barrier_timeout)
            stamps.clear()
            current["round"], current["said"] = r, False
            t0, c0 = time.monotonic(), time.process_time()
            worker.force_sync()
            t1, c1 = time.monotonic(), time.process_time()
            if kill is None:
                finished.wait(barrier_timeout)
            after = worker.sync_metrics
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
            entry = {
                "round": r,
                "t0": t0,
                "t1": t1,
                "cpu_s": c1 - c0,
                "phases": phases(stamps.d, t0, t1, mode),
                "events": stamps.events,
                "server_round": after["round"],
                "delta": delta,
            }
            if kill is None:
                entry["checksum"] = checksum(model)  # equal: every worker holds the same state
                out.put(("round", idx, entry))
            else:
                log.append(entry)
    out.put(("done", idx, {"maxrss": maxrss(), "rss_end": rss(), "log": log}))
