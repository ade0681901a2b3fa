"""What runs inside allreduce_round.py's spawned processes: the server (either mode) and workers.

The model is the sync-round benchmark's (``sync_round_children.choose_shape`` / ``build_model``:
square bias-free ``nn.Linear`` layers, seed 0 on every worker, so that all-reduce workers start
from the same state and no broadcast happens at the start).

Server (``server_main``): ``DiLoCoServer`` on 127.0.0.1 in server mode (initial parameters from
a safetensors file, so no worker uploads them) or in all-reduce mode (no parameters). In
all-reduce mode the quorum replies name a rendezvous store: when a counting proxy stands in
front of it, the server child hands out the proxy's address instead of the store's own
(``book.rendezvous``, benchmark-side instrumentation; the library is untouched), so that the
store traffic is counted as well.

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

from harness.rss import base_rss, maxrss, rss
from sync_round_children import ModelShape, build_model

# --- server ----------------------------------------------------------------------------------


def server_main(
    conn: Any,
    mode: str,
    num_workers: int,
    params_path: str | None,
    store_proxy: tuple[str, int] | None,
    heartbeat_timeout: float,
    collective_timeout: float,
    threads: int,
    host: str = "127.0.0.1",
) -> None:
    """``mode``: "server" or "allreduce"; ``host``: the address to bind (netns_links.py binds the
    server namespace's). Answers "status" and "stop" on ``conn``."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from diloco.server import DiLoCoServer, ServerConfig

    base = base_rss()
    allreduce = mode == "allreduce"
    config = ServerConfig(
        host=host,
        port=0,
        num_workers=num_workers,
        initial_params=None if allreduce else params_path,
        allreduce=allreduce,
        heartbeat_timeout=heartbeat_timeout,
        stuck_timeout=0,
        collective_timeout=collective_timeout,
    )
    server = DiLoCoServer(config).start()
    store_port = None
    if allreduce:
        book = server.front.book  # type: ignore[attr-defined]
        store_port = int(book.rendezvous[1])
        if store_proxy is not None:
            book.rendezvous = (str(store_proxy[0]), int(store_proxy[1]))
    conn.send(
        {
            "address": server.address,
            "port": server.port,
            "store_port": store_port,
            "base_rss": base,
            "rss_started": rss(),
            "pid": os.getpid(),
        }
    )
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd == "status":
                conn.send(server.status())
            elif cmd == "stop":
                conn.send({"status": server.status(), "maxrss": maxrss(), "rss_end": rss()})
                return
    finally:
        server.stop(timeout=10)


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
        submit = client.submit_pseudogradients
        into = worker._local._into_snapshot

        def timed_submit(*a: Any, **k: Any) -> Any:
            reply = submit(*a, **k)
            stamps.mark("submitted")
            return reply

        def timed_into(layout: Any) -> Any:
            stamps.mark("body")
            return into(layout)

        client.submit_pseudogradients = timed_submit
        worker._local._into_snapshot = timed_into
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
    average, all_equal, outer = ar.average, ar.all_equal, whole.apply_outer_step

    def timed_build(cls: Any, *a: Any, **k: Any) -> Any:
        group = build(cls, *a, **k)
        stamps.mark("group_built")
        return group

    def timed_average(*a: Any, **k: Any) -> Any:
        stamps.mark("average_start")
        total = average(*a, **k)
        stamps.mark("average_end")
        return total

    def timed_all_equal(*a: Any, **k: Any) -> Any:
        same = all_equal(*a, **k)
        stamps.mark("committed")
        return same

    def timed_outer(*a: Any, **k: Any) -> Any:
        outer(*a, **k)
        stamps.mark("outer_done")

    ar.QuorumCollective.build = classmethod(timed_build)  # type: ignore[method-assign,assignment]
    ar.average = timed_average
    ar.all_equal = timed_all_equal
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


def perturb(model: Any, optimizer: Any, noise: Any, gen: Any) -> None:
    """Stand-in for H local steps: a small change to every weight (as sync_round_children),
    and one ``optimizer.step()`` without gradients (it changes nothing) so that the worker
    counts a local step: an all-reduce worker with no step since its last sync contributes
    with weight 0, and a quorum whose weights are all 0 averages nothing."""
    import torch

    optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            for start in range(0, flat.numel(), noise.numel()):
                part = flat[start : start + noise.numel()]
                noise.normal_(0.0, 1e-3, generator=gen)
                part.add_(noise[: part.numel()])


def say_inside(out: Any, idx: int, kill: dict[str, Any]) -> None:
    """A worker reached the all-reduce of the kill round. The victim says so on a pipe of its
    own and blocks until it is killed: a SIGKILL may catch it holding the lock of what it wrote
    to, and the survivors still write to the shared queue."""
    if kill["victim"]:
        kill["conn"].send({"t": time.monotonic()})
        threading.Event().wait()  # until killed, never issuing the collective
    out.put(("inside", idx, {"t": time.monotonic()}))


def worker_main(idx: int, out: Any, *rest: Any) -> None:
    """A worker child (arguments as ``_worker_body``'s); its failure reaches the parent at once."""
    try:
        _worker_body(idx, out, *rest)
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


def _worker_body(
    idx: int,
    out: Any,
    address: str,
    shape: ModelShape,
    mode: str,
    bf16: bool,
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
    noise = torch.empty(min(shape.dim * shape.dim, 1 << 20))
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
        bf16_comm=bf16,
        worker_id=f"bench-{idx:02d}",
        heartbeat_interval=heartbeat,
    ) as worker:
        instrument(worker, stamps, mode)
        out.put(("ready", idx, {"base_rss": base, "rss_joined": rss(), "pid": os.getpid()}))
        log = []
        for r in range(total_rounds):
            perturb(model, optimizer, noise, gen)
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
                with torch.no_grad():  # equal fp32 sums: every worker holds the same parameters
                    entry["checksum"] = sum(float(p.sum()) for p in model.parameters())
                out.put(("round", idx, entry))
            else:
                log.append(entry)
    out.put(("done", idx, {"maxrss": maxrss(), "rss_end": rss(), "log": log}))
