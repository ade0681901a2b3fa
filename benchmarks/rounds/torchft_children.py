"""What runs inside torchft_diloco's spawned processes: torchft's lighthouse and its replicas.

torchft (``pip install torchft==0.2.0``; a benchmark-only extra) is imported only here, inside
the children. A replica is one process, a replica group of world size 1 with its own
``TCPStore``, running ``torchft.local_sgd.DiLoCo`` over a ``Manager`` and a
``ProcessGroupGloo``; its round is ``allreduce_children``'s (perturb, barrier, one timed
``optimizer.step()`` that is torchft's sync, report), and its messages to the parent are a
``harness.session.Session`` member's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.harness.model import ModelShape, build_model, checksum, noise_buffer, perturb
from benchmarks.harness.rss import base_rss, maxrss, rss
from benchmarks.harness.session import run_member


def lighthouse_main(
    conn: Any, min_replicas: int, join_timeout_ms: int | None, heartbeat_timeout_ms: int | None
) -> None:
    from torchft.coordination import LighthouseServer

    kw: dict[str, Any] = {}
    if join_timeout_ms is not None:
        kw["join_timeout_ms"] = join_timeout_ms
    if heartbeat_timeout_ms is not None:
        kw["heartbeat_timeout_ms"] = heartbeat_timeout_ms
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, **kw)
    conn.send({"address": server.address(), "pid": os.getpid()})
    try:
        conn.recv()  # "stop", or EOF when the parent goes
    except EOFError:
        pass
    finally:
        server.shutdown()


def replica_main(idx: int, out: Any, *rest: Any) -> None:
    """A replica child (arguments as ``_replica_body``'s)."""
    run_member(_replica_body, idx, out, *rest)


def _replica_body(
    idx: int,
    out: Any,
    lighthouse: str,
    shape: ModelShape,
    min_replicas: int,
    timeout_s: float,
    quorum_timeout_s: float,
    total_rounds: int,
    barrier: Any,
    finished: Any,
    barrier_timeout: float,
    kill: dict[str, Any] | None,
) -> None:
    import logging
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.WARNING)
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from benchmarks.rounds.allreduce_children import say_inside

    base = base_rss()
    model = build_model(shape)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), None)[1],
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{idx}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    stamps: dict[str, float] = {}
    current = {"round": -1, "said": False}

    def mark(what: str) -> None:
        stamps.setdefault(what, time.monotonic())

    allreduce = pg.allreduce

    def timed_allreduce(*a: Any, **k: Any) -> Any:
        mark("allreduce_issued")
        if kill is not None and current["round"] == kill["round"] and not current["said"]:
            current["said"] = True
            say_inside(out, idx, kill)
        return allreduce(*a, **k)

    pg.allreduce = timed_allreduce
    start_quorum, should_commit = manager.start_quorum, manager.should_commit

    def timed_start_quorum(*a: Any, **k: Any) -> Any:
        result = start_quorum(*a, **k)
        mark("quorum")
        return result

    def timed_should_commit(*a: Any, **k: Any) -> Any:
        mark("commit_asked")
        result = should_commit(*a, **k)
        mark("commit_answered")
        return result

    manager.start_quorum = timed_start_quorum
    manager.should_commit = timed_should_commit
    noise = noise_buffer(shape)
    gen = torch.Generator().manual_seed(1000 + idx)
    out.put(("ready", idx, {"base_rss": base, "rss_joined": rss(), "pid": os.getpid()}))
    log = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=1, pin_memory=False):
            if kill is not None:
                # Every replica's manager heartbeats to the lighthouse before any asks for a
                # quorum: with min_replicas N-1, a replica still starting would be left out.
                barrier.wait(barrier_timeout)
            for r in range(total_rounds):
                perturb(model, noise, gen)  # torchft's optimizer is not stepped: that would sync
                if kill is None:
                    out.put(("prepared", idx, {"round": r}))
                    barrier.wait(barrier_timeout)
                stamps.clear()
                current["round"], current["said"] = r, False
                step0 = manager.current_step()
                t0, c0 = time.monotonic(), time.process_time()
                error = None
                try:
                    inner.step()  # no gradients: only torchft's hooks do anything (the sync)
                except Exception as exc:  # kill runs: a survivor's failure is a result
                    if kill is None:
                        raise
                    error = f"{type(exc).__name__}: {exc}"
                t1, c1 = time.monotonic(), time.process_time()
                if kill is None:
                    finished.wait(barrier_timeout)
                committed = manager.current_step() - step0
                s = dict(stamps)
                ph = None
                if {"quorum", "allreduce_issued", "commit_asked", "commit_answered"} <= s.keys():
                    ph = {
                        "quorum_s": s["quorum"] - t0,
                        "pseudograd_issue_s": s["allreduce_issued"] - s["quorum"],
                        "allreduce_wait_restore_s": s["commit_asked"] - s["allreduce_issued"],
                        "should_commit_s": s["commit_answered"] - s["commit_asked"],
                        "outer_step_s": t1 - s["commit_answered"],
                    }
                entry = {
                    "round": r,
                    "t0": t0,
                    "t1": t1,
                    "cpu_s": c1 - c0,
                    "committed": committed,
                    "phases": ph,
                    "stamps": s,
                    "error": error,
                    "participants": participants(manager),
                }
                if kill is None:
                    entry["checksum"] = checksum(model)
                    out.put(("round", idx, entry))
                else:
                    log.append(entry)
                    if error is not None:
                        break  # the training loop would have died here
    finally:
        manager.shutdown(wait=False)
    out.put(("done", idx, {"maxrss": maxrss(), "rss_end": rss(), "log": log}))


def participants(manager: Any) -> int | None:
    """The quorum's size; None when the quorum itself failed (asking re-raises its error)."""
    try:
        return int(manager.num_participants())
    except Exception:
        return None
