"""torchft's DiLoCo beside this project's all-reduce mode (issue 19), in one run, on loopback.

torchft (``pip install torchft==0.2.0``; a benchmark-only extra, not in requirements-lock.txt)
runs DiLoCo as ``torchft.local_sgd.DiLoCo`` over a ``torchft.manager.Manager`` per replica, a
``torchft.coordination.LighthouseServer`` that forms quorums, and a reconfigurable
``torchft.process_group.ProcessGroupGloo``. Here each replica is one spawned process (a replica
group of world size 1 with its own ``TCPStore``), the lighthouse another; the model is the
sync-round benchmark's (``sync_round_children.build_model``, seed 0 everywhere, so
``init_sync=False``: no checkpoint transfer at the start); inner optimizer SGD, outer SGD
(lr 0.7, momentum 0.9, Nesterov) as this project's defaults; ``sync_every=1``, so that every
``optimizer.step()`` is one sync (its SGD part is a no-op: no gradients).

A round is measured as allreduce_round.py measures ours: each replica perturbs its weights
(outside the round), all meet at a barrier with the parent, each times ``optimizer.step()``
(torchft's sync: the quorum, the pseudo-gradients, one gloo all-reduce per parameter in fp32,
``should_commit``, the outer step), and the round is the latest end minus the earliest start.
The same run then measures our all-reduce mode (``allreduce_round.Session``, fp32 as torchft
sends, and bf16, today's default) on the same model and worker counts. Peak RSS: ``ru_maxrss``
of each replica at its end, against the fp32 model size and above the RSS after importing torch.

``--kill``: a replica killed with SIGKILL inside the all-reduce, torchft and ours. torchft's
victim wraps its process group's ``allreduce`` to say so and block at round ``--kill-round``;
the survivors say when they issued theirs; the parent kills the victim once all did. For each
survivor: seconds from the kill until its next committed sync (how long it was blocked), for
each lighthouse join timeout in ``--torchft-join-timeouts`` (default 10 s, and 60 s: the
``torchft_lighthouse`` binary's default; the Python ``LighthouseServer`` defaults to 100 ms, with
which quorums form without a replica that asks a moment late), with min_replicas N-1 and the
lighthouse's default heartbeat timeout (5 s). Ours: the
same through allreduce_round.py's kill run (``ServerConfig(heartbeat_timeout=5)``).

Usage (from the repository root)::

    .venv/bin/python benchmarks/torchft_diloco.py --params 5e6 --workers 2 4 --kill
    .venv/bin/python benchmarks/torchft_diloco.py --params 100e6 --workers 2 4 --kill \\
        --json benchmarks/results/torchft_diloco_100M.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from typing import Any

import psutil

import allreduce_round as ours
from harness.processes import Inbox, check_alive, reap, start_and_collect
from harness.report import fmt_mb, machine_info, print_table, summary, write_json
from harness.rss import RssPoller, base_rss, maxrss, rss
from sync_round_children import ModelShape, build_model, choose_shape

# --- children --------------------------------------------------------------------------------


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
    try:
        _replica_body(idx, out, *rest)
    except BaseException as exc:
        import traceback

        out.put(("error", idx, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


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

    from allreduce_round_children import perturb, say_inside

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

    pg.allreduce = timed_allreduce  # type: ignore[method-assign]
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

    manager.start_quorum = timed_start_quorum  # type: ignore[method-assign]
    manager.should_commit = timed_should_commit  # type: ignore[method-assign]
    noise = torch.empty(min(shape.dim * shape.dim, 1 << 20))
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
                with torch.no_grad():
                    perturb(model, _NoStep(), noise, gen)
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
                    with torch.no_grad():
                        entry["checksum"] = sum(float(p.sum()) for p in model.parameters())
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


class _NoStep:
    """``perturb`` steps an optimizer so that our worker counts a local step; torchft's sync
    must not run while perturbing, so its optimizer is not stepped there."""

    def step(self) -> None:
        pass


# --- the parent's side -----------------------------------------------------------------------


class TorchftSession:
    """A lighthouse process and N replica processes, driven one round at a time (or, with
    ``kill``, left to run until the victim is killed)."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        shape: ModelShape,
        args: argparse.Namespace,
        *,
        rounds: int,
        kill: dict[str, Any] | None = None,
        join_timeout_s: float | None = None,
    ) -> None:
        self.ctx, self.n, self.shape, self.args = ctx, n, shape, args
        self.total_rounds, self.kill = rounds, kill
        self.join_timeout_s = join_timeout_s
        self.min_replicas = n - 1 if kill is not None else n
        self.setup_timeout = args.setup_timeout + 15 * n
        self.procs: list[Any] = []
        self.poller = RssPoller()
        self.rounds: list[dict[str, Any]] = []

    def __enter__(self) -> TorchftSession:
        self.poller.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.poller.__exit__()
        if getattr(self, "conn", None) is not None:
            try:
                self.conn.send("stop")
            except OSError:
                pass
        reap(self.procs)

    def _start(self) -> None:
        ctx, n, args = self.ctx, self.n, self.args
        self.conn, child = ctx.Pipe()
        join_ms = None if self.join_timeout_s is None else int(self.join_timeout_s * 1000)
        self.lighthouse = ctx.Process(
            target=lighthouse_main,
            args=(child, self.min_replicas, join_ms, None),
            name="lighthouse",
            daemon=True,
        )
        self.procs.append(self.lighthouse)
        self.lighthouse.start()
        if not self.conn.poll(self.setup_timeout):
            raise TimeoutError("the lighthouse did not start")
        self.hello = self.conn.recv()
        self.lighthouse_proc = psutil.Process(self.hello["pid"])
        self.barrier = ctx.Barrier(n + 1)
        self.finished = ctx.Barrier(n)
        self.inbox = Inbox(ctx.Queue())
        self.replicas = []
        self.victim_conn, victim_end = ctx.Pipe(duplex=False)
        for i in range(n):
            kill = None
            if self.kill is not None:
                victim = i == n - 1
                kill = {**self.kill, "victim": victim, "conn": victim_end if victim else None}
            self.replicas.append(
                ctx.Process(
                    target=replica_main,
                    args=(
                        i,
                        self.inbox.q,
                        self.hello["address"],
                        self.shape,
                        self.min_replicas,
                        args.torchft_timeout,
                        args.torchft_quorum_timeout,
                        self.total_rounds,
                        self.barrier,
                        self.finished,
                        self.setup_timeout + args.round_timeout,
                        kill,
                    ),
                    name=f"replica-{i}",
                    daemon=True,
                )
            )
        self.procs.extend(self.replicas)
        for p in self.replicas:
            p.start()
            self.poller.watch(p.pid)
        self.ready = self.inbox.collect("ready", n, self.setup_timeout, f"N={n} replica setup")

    def round(self) -> dict[str, Any]:
        n, args = self.n, self.args
        r = len(self.rounds)
        what = f"N={n} torchft round {r}"
        check_alive(self.procs, what)
        self.inbox.collect("prepared", n, args.round_timeout, what)
        msgs, cpu = start_and_collect(
            self.barrier, self.inbox, self.lighthouse_proc, n, args.round_timeout, what
        )
        ph = [m["phases"] for m in msgs.values()]
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "wall_s": max(m["t1"] for m in msgs.values()) - min(m["t0"] for m in msgs.values()),
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": {"lighthouse": cpu["server"], "workers": cpu["workers"]},
            "phases": (
                {k: statistics.median(p[k] for p in ph) for k in ph[0]}
                if ph and None not in ph
                else None
            ),
            "committed": [m["committed"] for m in msgs.values()],
            "consistent": len({m["checksum"] for m in msgs.values()}) == 1,
        }
        self.rounds.append(result)
        if args.verbose:
            print(f"    {what}: {result['wall_s']:.3f} s {result['phases']}", flush=True)
        return result

    def finish(self) -> dict[str, Any]:
        n = self.n
        done = self.inbox.collect("done", n, self.setup_timeout, f"N={n} replica shutdown")
        measured = [r for r in self.rounds if not r["warmup"]]
        keys = list(measured[0]["phases"]) if measured[0]["phases"] else []
        return {
            "config": "torchft fp32",
            "workers": n,
            "rounds": self.rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "phases_median": (
                {k: statistics.median(r["phases"][k] for r in measured) for k in keys}
                if all(r["phases"] for r in measured)
                else None
            ),
            "cpu_s_median": {
                k: statistics.median(r["cpu_s"][k] for r in measured)
                for k in ("lighthouse", "workers")
            },
            "all_rounds_ok": all(
                r["consistent"] and all(c == 1 for c in r["committed"]) for r in self.rounds
            ),
            "worker": {
                "maxrss": max(d["maxrss"] for d in done.values()),
                "maxrss_each": [done[i]["maxrss"] for i in sorted(done)],
                "base_rss": max(r["base_rss"] for r in self.ready.values()),
                "rss_after_join": max(r["rss_joined"] for r in self.ready.values()),
                "polled_peak_rss": max(self.poller.peaks.get(p.pid, 0) for p in self.replicas),
            },
        }

    def kill_inside(self) -> dict[str, Any]:
        n, args = self.n, self.args
        victim = self.replicas[-1]
        wait = self.setup_timeout + args.round_timeout
        self.barrier.wait(wait)  # all replicas ready: they start together
        inside, late = ours.wait_inside(self.inbox, self.victim_conn, n, wait)
        os.kill(victim.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        done = self.inbox.collect("done", n - 1, wait, "the survivors after the kill")
        survivors = []
        for i in sorted(done):
            log = done[i]["log"]
            after = [e for e in log if e["t1"] > t_kill]
            hit = next((e for e in after if e["committed"]), None)
            first = after[0] if after else None
            errors = [e for e in log if e["error"]]
            survivors.append(
                {
                    "worker": i,
                    "raised": (
                        None
                        if not errors
                        else {"s_after_kill": errors[0]["t1"] - t_kill, "error": errors[0]["error"]}
                    ),
                    "syncs": len(log),
                    "failed_sync_ended_s": None if first is None else first["t1"] - t_kill,
                    "failed_sync_committed": None if first is None else bool(first["committed"]),
                    "failed_sync_participants": None if first is None else first["participants"],
                    "next_quorum_s": (
                        None
                        if hit is None or "quorum" not in hit["stamps"]
                        else hit["stamps"]["quorum"] - t_kill
                    ),
                    "blocked_s": None if hit is None else hit["t1"] - t_kill,
                    "uncommitted_syncs_after_kill": sum(
                        1
                        for e in after
                        if not e["committed"] and (hit is None or e["t1"] < hit["t1"])
                    ),
                    "later_syncs_s": [
                        e["t1"] - e["t0"] for e in after if hit is not None and e["t0"] > hit["t1"]
                    ],
                }
            )
        return {
            "workers": n,
            "victim": n - 1,
            "kill_round": self.kill["round"] if self.kill else None,
            "join_timeout_s": self.join_timeout_s,
            "timeout_s": args.torchft_timeout,
            "quorum_timeout_s": args.torchft_quorum_timeout,
            "inside_before_kill_s": {str(i): t_kill - v["t"] for i, v in sorted(inside.items())},
            "not_inside": late,
            "survivors": survivors,
            "worker_maxrss": [done[i]["maxrss"] for i in sorted(done)],
            "logs": {  # each survivor's syncs, times in s after the kill
                str(i): [
                    {
                        "round": e["round"],
                        "start": e["t0"] - t_kill,
                        "end": e["t1"] - t_kill,
                        "committed": e["committed"],
                        "participants": e["participants"],
                        "stamps": {k: v - t_kill for k, v in e["stamps"].items()},
                        "error": e["error"],
                    }
                    for e in done[i]["log"]
                ]
                for i in sorted(done)
            },
        }


def run_torchft(ctx: Any, n: int, shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    with TorchftSession(ctx, n, shape, args, rounds=args.warmup + args.rounds) as s:
        for _ in range(args.warmup + args.rounds):
            s.round()
        return s.finish()


def run_torchft_kill(
    ctx: Any, shape: ModelShape, args: argparse.Namespace, join_timeout_s: float | None
) -> dict[str, Any]:
    kill = {"round": args.kill_round}
    rounds = args.kill_round + 1 + args.kill_after
    with TorchftSession(
        ctx, args.kill_workers, shape, args, rounds=rounds, kill=kill, join_timeout_s=join_timeout_s
    ) as s:
        res = s.kill_inside()
    res["params"] = shape.numel
    return res


# --- report ----------------------------------------------------------------------------------


def _x(b: float, model: int) -> str:
    return f"{fmt_mb(b)} ({b / model:.2f}x)"


def print_tables(results: list[dict[str, Any]], model_bytes: int) -> None:
    print_table(
        [
            "N",
            "config",
            "sync s median (min-max)",
            "worker peak RSS MB (x model)",
            "worker peak above torch base (x model)",
            "rounds ok",
        ],
        [
            [
                str(d["workers"]),
                d["config"],
                f"{d['round_s']['median']:.2f} ({d['round_s']['min']:.2f}-{d['round_s']['max']:.2f})",
                _x(d["worker"]["maxrss"], model_bytes),
                f"{(d['worker']['maxrss'] - d['worker']['base_rss']) / model_bytes:.2f}x",
                "yes" if d["all_rounds_ok"] else "NO",
            ]
            for d in results
        ],
    )
    for d in results:
        if d["phases_median"]:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in d["phases_median"].items())
            print(f"- N={d['workers']} {d['config']}: {parts}")


def print_torchft_kill(res: dict[str, Any]) -> None:
    jt = res["join_timeout_s"]
    print(
        f"\ntorchft: replica killed inside the all-reduce ({res['workers']} replicas, "
        f"{res['params']:,} params; lighthouse min_replicas {res['workers'] - 1}, join timeout "
        f"{'LighthouseServer default (0.1 s)' if jt is None else f'{jt:g} s'}, heartbeat timeout "
        "default (5 s); "
        f"Manager and ProcessGroupGloo timeout {res['timeout_s']:g} s, quorum timeout "
        f"{res['quorum_timeout_s']:g} s); seconds after the SIGKILL:"
    )

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    print_table(
        [
            "survivor",
            "raised (s after kill: error)",
            "interrupted sync returned (committed?, quorum size)",
            "next quorum",
            "next committed sync ended (blocked)",
            "later syncs s",
        ],
        [
            [
                str(s["worker"]),
                "-"
                if s["raised"] is None
                else f"{s['raised']['s_after_kill']:.2f}: {s['raised']['error'][:80]}",
                f"{f(s['failed_sync_ended_s'])} ({s['failed_sync_committed']}, "
                f"{s['failed_sync_participants']})",
                f(s["next_quorum_s"]),
                f(s["blocked_s"]),
                ", ".join(f"{x:.2f}" for x in s["later_syncs_s"]) or "-",
            ]
            for s in res["survivors"]
        ],
    )
    if res["not_inside"]:
        print("not all inside the all-reduce: " + "; ".join(res["not_inside"]))


def print_kill_summary(kills: list[dict[str, Any]], our_kill: list[dict[str, Any]]) -> None:
    """One line per kill run: each survivor's seconds from the SIGKILL to its next completed
    (committed) sync, and what raised."""
    rows = []
    for k in kills:
        jt = k["join_timeout_s"]
        rows.append(
            [
                "torchft",
                f"join timeout {'0.1 (default)' if jt is None else f'{jt:g}'} s, "
                f"timeout {k['timeout_s']:g} s, quorum timeout {k['quorum_timeout_s']:g} s",
                ", ".join(
                    "-" if s["blocked_s"] is None else f"{s['blocked_s']:.2f}"
                    for s in k["survivors"]
                ),
                "; ".join(
                    f"survivor {s['worker']} at {s['raised']['s_after_kill']:.1f} s: "
                    f"{s['raised']['error'][:60]}"
                    for s in k["survivors"]
                    if s["raised"]
                )
                or "-",
            ]
        )
    for k in our_kill:
        rows.append(
            [
                "ours",
                f"heartbeat timeout {k['heartbeat_timeout_s']:g} s, collective timeout "
                f"{k['collective_timeout_s']:g} s",
                ", ".join(
                    "-" if s.get("blocked_s") is None else f"{s['blocked_s']:.2f}"
                    for s in k["survivors"]
                ),
                "-",
            ]
        )
    print("\nKill runs: each survivor's seconds from the SIGKILL to its next completed sync:")
    print_table(["system", "settings", "blocked s (each survivor)", "raised"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ours.add_args(ap)
    ap.set_defaults(workers=[2, 4])
    ap.add_argument(
        "--torchft-timeout",
        type=float,
        default=30.0,
        help="torchft Manager and ProcessGroupGloo timeouts, s (default 30, as our "
        "collective_timeout)",
    )
    ap.add_argument(
        "--torchft-quorum-timeout",
        type=float,
        default=120.0,
        help="torchft Manager quorum_timeout, s (default 120: longer than the 60 s join "
        "timeout, so that a survivor waiting for a quorum is measured, not cut "
        "short by its own timeout; torchft's default is 60)",
    )
    ap.add_argument(
        "--torchft-join-timeouts",
        type=float,
        nargs="+",
        default=[10.0, 60.0],
        help="lighthouse join timeouts of the kill runs, s (default 10 and 60, the "
        "torchft_lighthouse binary's default; 0: LighthouseServer's own default, 100 ms)",
    )
    ap.add_argument("--no-ours", action="store_true", help="torchft only")
    ap.add_argument("--no-torchft", action="store_true", help="ours only")
    ap.add_argument("--kill-only", action="store_true", help="only the kill runs (needs --kill)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    code = ours.use_src(args.src)
    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    info = machine_info()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    from importlib.metadata import version  # the parent never imports torch

    versions = {k: version(k) for k in ("torchft", "torch")}
    print(
        f"{started}; model: {shape.layers} x Linear({shape.dim}, {shape.dim}, bias=False) = "
        f"{shape.numel:,} params, {fmt_mb(model_bytes)} MB fp32; rounds {args.warmup} warm-up "
        f"+ {args.rounds} measured; {versions}",
        flush=True,
    )
    print(f"machine: {info['nproc']} CPUs, {info['ram_gib']} GiB RAM, {info['cpu']}", flush=True)
    print(f"code: {code}", flush=True)
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in [] if args.kill_only else sorted(set(args.workers)):
        runs: list[tuple[str, Any]] = [] if args.no_torchft else [("torchft fp32", None)]
        if not args.no_ours:
            runs += [
                ("ours", ours.Config("allreduce", False, proxied=False)),
                ("ours", ours.Config("allreduce", True, proxied=False)),
            ]
        for label, cfg in runs:
            need = (
                int(n * (8.5 * model_bytes + ours.OVERHEAD))
                if cfg is None
                else ours.estimate_bytes(n, model_bytes, cfg)
            )
            tag = f"N={n} {label if cfg is None else cfg.label}"
            msg = ours.fits(need, tag, args.force)
            if msg:
                print(msg, flush=True)
                skipped.append(msg)
                continue
            print(f"{tag} ...", flush=True)
            t = time.monotonic()
            if cfg is None:
                d = run_torchft(ctx, n, shape, args)
            else:
                d = ours.run_config(ctx, cfg, n, shape, "", args)
                d["config"] = "ours " + d["config"]
            print(
                f"{tag}: sync median {d['round_s']['median']:.3f} s; phases "
                f"{d['phases_median']}; worker peak {fmt_mb(d['worker']['maxrss'])} MB; "
                f"took {time.monotonic() - t:.0f} s",
                flush=True,
            )
            results.append(d)
    kills: list[dict[str, Any]] = []
    our_kill: list[dict[str, Any]] | None = None
    if args.kill:
        kshape = choose_shape(args.kill_params or args.params, args.max_dim)
        for jt in [] if args.no_torchft else args.torchft_join_timeouts:
            join = None if jt <= 0 else jt
            for i in range(args.kill_repeats):
                print(
                    f"torchft kill run {i + 1}/{args.kill_repeats}, join timeout "
                    f"{join or 'default'} ...",
                    flush=True,
                )
                kills.append(run_torchft_kill(ctx, kshape, args, join))
        if not args.no_ours:
            our_kill = []
            for i in range(args.kill_repeats):
                print(f"our kill run {i + 1}/{args.kill_repeats} ...", flush=True)
                our_kill.append(ours.run_kill(ctx, kshape, args))
    print()
    if results:
        print_tables(results, model_bytes)
        print(f"\nModel = {fmt_mb(model_bytes)} MB fp32; MB = 10**6 B.")
    for k in kills:
        print_torchft_kill(k)
    for k in our_kill or []:
        ours.print_kill(k)
    if kills or our_kill:
        print_kill_summary(kills, our_kill or [])
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "torchft_diloco",
                "date": started,
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "machine": info,
                "code": code,
                "versions": versions,
                "model": {"dim": shape.dim, "layers": shape.layers, "numel": shape.numel},
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "results": results,
                "torchft_kill": kills,
                "our_kill": our_kill,
                "skipped": skipped,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
