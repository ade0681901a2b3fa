"""Server mode against all-reduce mode (issue 19) on loopback, side by side in one run.

For a model of P fp32 parameters (the sync-round benchmark's stack of square bias-free
``nn.Linear`` layers, ``sync_round_children.choose_shape``) and each worker count N, these
configurations run back to back, each on a fresh server and fresh worker processes:

* ``server bf16``: ``DiLoCoServer(ServerConfig(num_workers=N))`` holding the parameters (loaded
  from a safetensors file, so that no worker uploads them), workers with ``bf16_comm=True``
  (today's default: bf16 pseudo-gradients up, fp32 parameters down);
* ``allreduce bf16``: ``ServerConfig(num_workers=N, allreduce=True)``, the same workers with
  ``bf16_comm=True``: they average their pseudo-gradients in bf16 with gloo on a process group
  per quorum and each applies the outer Nesterov step;
* ``allreduce fp32`` (``--allreduce-fp32``): the same with ``bf16_comm=False``.

A round (as ``sync_round.py``'s): every worker perturbs its weights (standing in for local
training, outside the round), all meet at a barrier with the parent, and each times
``force_sync()``. The round's wall time runs from the earliest start after the barrier to the
latest end: the slowest worker's sync, with zero inner-step time. The all-reduce round includes
everything the worker does for it: ``POST /quorum`` until every worker asked, building the
quorum's gloo group through the rendezvous store, the pseudo-gradient, the averaging collectives,
the commit check, the outer step, the new state's hash and ``POST /quorum/outcome``.

Bytes through the server process: every worker reaches the server through a counting TCP proxy
(``counting_proxy.py``, a child process relaying with ``splice``), which counts the TCP payload
each way between two readings taken while everything is idle (before the barrier is released,
after every worker reported). In all-reduce mode the rendezvous store (a ``TCPStore`` the server
process hosts on a second port) is proxied too: the server child hands out the proxy's address
in its quorum replies. So the figures are all bytes into and out of the server process during
a round, HTTP headers and JSON included. The server's own ``/status`` counters (the bodies it
counts) are shown beside them. Workers send no heartbeats in these rounds (as in
``sync_round.py``); ``--direct`` runs the server mode a second time without the proxy, to show
what relaying its hundreds of MB costs the round time.

Memory: each worker reads its ``ru_maxrss`` at its end (exact) and its RSS after importing torch
(``base``), shown against the fp32 model size: a server-mode worker holds the model and the
snapshot (plus transient buffers), an all-reduce worker the model, the snapshot, the outer
momentum and the averaging buffer (about 4 models).

``--kill``: a worker killed with SIGKILL inside the all-reduce (``--kill-workers`` workers,
heartbeats every ``--kill-heartbeat-interval`` s, ``ServerConfig(heartbeat_timeout=...)``). As
tests/programs/allreduce_victim.py, the victim patches ``QuorumCollective.collective`` to say so and block at
its first all-reduce of round ``--kill-round``; the parent kills it once every survivor has said
it is inside that all-reduce too. For each survivor: the kill until its collective failed and it
reported the round discarded, until its next quorum, and until that round completed (how long it
was blocked).

Usage (from the repository root; MB = 10**6 bytes)::

    .venv/bin/python benchmarks/allreduce_round.py --params 5e6 --workers 2 4 --kill
    .venv/bin/python benchmarks/allreduce_round.py --params 100e6 --workers 2 4 8 \\
        --allreduce-fp32 --direct --json benchmarks/results/allreduce_round_100M.json

``--src DIR`` runs the children from another copy of the code, e.g. a snapshot of a commit
taken while others keep editing the checkout::

    mkdir -p /tmp/snap && git archive HEAD src | tar -x -C /tmp/snap
    git rev-parse HEAD > /tmp/snap/COMMIT
    .venv/bin/python benchmarks/allreduce_round.py --src /tmp/snap/src ...
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from allreduce_round_children import server_main, worker_main
from counting_proxy import CountingProxy, diff
from harness.processes import Inbox, check_alive, cpu_s, reap, start_and_collect
from harness.report import fmt_mb, machine_info, print_table, summary, write_json
from harness.rss import RssPoller
from sync_round_children import ModelShape, choose_shape, write_params_main

OVERHEAD = 350 * 2**20  # an interpreter with torch and diloco imported


@dataclass(frozen=True)
class Config:
    mode: str  # "server" or "allreduce"
    bf16: bool
    proxied: bool = True

    @property
    def label(self) -> str:
        comm = "bf16" if self.bf16 else "fp32"
        return f"{self.mode} {comm}" + ("" if self.proxied else " (direct)")


def estimate_bytes(n: int, model_bytes: int, cfg: Config) -> int:
    """Expected peak of a configuration: server mode, the server ~4.5 models and each worker ~3;
    all-reduce mode, a small server and each worker ~4 models; an interpreter each."""
    if cfg.mode == "server":
        return int(4.5 * model_bytes + OVERHEAD + n * (3 * model_bytes + OVERHEAD))
    return int(OVERHEAD + n * (4.2 * model_bytes + OVERHEAD))


class Session:
    """A server process (behind a counting proxy unless ``cfg.proxied`` is False) and N worker
    processes, driven one round at a time (round mode) or left to run (``kill`` mode)."""

    def __init__(
        self,
        ctx: Any,
        cfg: Config,
        n: int,
        shape: ModelShape,
        params_path: str | None,
        args: argparse.Namespace,
        *,
        rounds: int,
        heartbeat_timeout: float = 0.0,
        kill: dict[str, Any] | None = None,
    ) -> None:
        self.ctx, self.cfg, self.n, self.shape = ctx, cfg, n, shape
        self.params_path, self.args, self.total_rounds = params_path, args, rounds
        self.heartbeat_timeout = heartbeat_timeout
        self.kill = kill
        self.setup_timeout = args.setup_timeout + 15 * n
        self.procs: list[Any] = []
        self.proxy: CountingProxy | None = None
        self.poller = RssPoller()
        self.rounds: list[dict[str, Any]] = []

    def __enter__(self) -> Session:
        self.poller.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.poller.__exit__()
        reap(self.procs)
        if self.proxy is not None:
            self.proxy.stop()

    def _start(self) -> None:
        ctx, n, cfg, args = self.ctx, self.n, self.cfg, self.args
        if cfg.proxied:
            self.proxy = CountingProxy(ctx, ["http", "store"])
            self.proxy_proc = psutil.Process(self.proxy.proc.pid)
        self.conn, child = ctx.Pipe()
        store_proxy = self.proxy.address("store") if self.proxy is not None else None
        self.server = ctx.Process(
            target=server_main,
            args=(
                child,
                cfg.mode,
                n,
                self.params_path,
                store_proxy,
                self.heartbeat_timeout,
                args.collective_timeout,
                args.server_threads,
            ),
            name="diloco-server",
            daemon=True,
        )
        self.procs.append(self.server)
        self.server.start()
        deadline = time.monotonic() + self.setup_timeout
        while not self.conn.poll(1.0):
            if not self.server.is_alive():
                raise RuntimeError(f"the server process died ({self.server.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not report its address")
        self.hello = self.conn.recv()
        self.poller.watch(self.hello["pid"])
        self.server_proc = psutil.Process(self.hello["pid"])
        address = self.hello["address"]
        if self.proxy is not None:
            store = self.hello["store_port"]
            self.proxy.point_at(
                {
                    "http": ("127.0.0.1", self.hello["port"]),
                    "store": None if store is None else ("127.0.0.1", store),
                }
            )
            address = f"127.0.0.1:{self.proxy.ports['http']}"
        self.barrier = ctx.Barrier(n + 1)
        self.finished = ctx.Barrier(n)
        self.inbox = Inbox(ctx.Queue())
        self.workers = []
        self.victim_conn, victim_end = ctx.Pipe(duplex=False)
        for i in range(n):
            kill = None
            if self.kill is not None:
                victim = i == n - 1
                kill = {**self.kill, "victim": victim, "conn": victim_end if victim else None}
            self.workers.append(
                ctx.Process(
                    target=worker_main,
                    args=(
                        i,
                        self.inbox.q,
                        address,
                        self.shape,
                        cfg.mode,
                        cfg.bf16,
                        self.total_rounds,
                        self.barrier,
                        self.finished,
                        self.setup_timeout + args.round_timeout,
                        kill,
                    ),
                    name=f"worker-{i}",
                    daemon=True,
                )
            )
        self.procs.extend(self.workers)
        for w in self.workers:
            w.start()
            self.poller.watch(w.pid)
        self.ready = self.inbox.collect("ready", n, self.setup_timeout, f"N={n} worker setup")

    def status(self) -> dict[str, Any]:
        self.conn.send("status")
        if not self.conn.poll(60):
            raise TimeoutError("server status timed out")
        return self.conn.recv()

    def _counts(self) -> dict[str, Any]:
        return self.proxy.counts() if self.proxy is not None else {}

    # --- round mode ------------------------------------------------------------------------

    def round(self) -> dict[str, Any]:
        n, args = self.n, self.args
        r = len(self.rounds)
        what = f"N={n} {self.cfg.label} round {r}"
        check_alive(self.procs, what)
        self.inbox.collect("prepared", n, args.round_timeout, what)  # idle at the barrier now
        status0, counts0 = self.status(), self._counts()
        proxy_cpu0 = cpu_s(self.proxy_proc) if self.proxy is not None else 0.0
        msgs, cpu = start_and_collect(
            self.barrier, self.inbox, self.server_proc, n, args.round_timeout, what
        )
        counts = diff(self._counts(), counts0) if self.proxy is not None else None
        if self.proxy is not None:
            cpu["proxy"] = cpu_s(self.proxy_proc) - proxy_cpu0
        status1 = self.status()
        t0 = min(m["t0"] for m in msgs.values())
        t1 = max(m["t1"] for m in msgs.values())
        deltas = [m["delta"] for m in msgs.values()]
        ph = [m["phases"] for m in msgs.values()]
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "wall_s": t1 - t0,
            "start_spread_s": max(m["t0"] for m in msgs.values()) - t0,
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": cpu,
            "phases": (
                {k: statistics.median(p[k] for p in ph) for k in ph[0]}
                if ph and None not in ph
                else None
            ),
            "proxy": counts,
            "server_status_bytes_in": status1["bytes_in"] - status0["bytes_in"],
            "server_status_bytes_out": status1["bytes_out"] - status0["bytes_out"],
            "worker_client_bytes_up": [d.get("bytes_up", 0) for d in deltas],
            "worker_client_bytes_down": [d.get("bytes_down", 0) for d in deltas],
            # All-reduce mode (from 3237867 on): the payload each worker averaged.
            "worker_collective_bytes": [d.get("collective_bytes", 0) for d in deltas],
            "worker_rounds": [d["rounds"] for d in deltas],
            "discarded": sum(d.get("discarded_rounds", 0) for d in deltas),
            "failed_syncs": sum(d["failed_syncs"] for d in deltas),
            "server_round": status1["round"],
            "consistent": len({m["checksum"] for m in msgs.values()}) == 1
            and len({m["server_round"] for m in msgs.values()}) == 1,
        }
        self.rounds.append(result)
        if args.verbose:
            print(f"    {what}: {result['wall_s']:.3f} s {result['phases']}", flush=True)
        return result

    def finish(self) -> dict[str, Any]:
        n = self.n
        done = self.inbox.collect("done", n, self.setup_timeout, f"N={n} worker shutdown")
        final = self._stop_server()
        measured = [r for r in self.rounds if not r["warmup"]]

        def med(f: Any) -> float:
            return statistics.median(f(r) for r in measured)

        proxied = self.proxy is not None
        phase_keys = measured[0]["phases"].keys() if measured[0]["phases"] else []
        return {
            "config": self.cfg.label,
            "mode": self.cfg.mode,
            "comm": "bf16" if self.cfg.bf16 else "fp32",
            "proxied": proxied,
            "workers": n,
            "rounds": self.rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "phases_median": {k: med(lambda r, k=k: r["phases"][k]) for k in phase_keys}
            if all(r["phases"] for r in measured)
            else None,
            "cpu_s_median": {k: med(lambda r, k=k: r["cpu_s"][k]) for k in measured[0]["cpu_s"]},
            "server_bytes": (
                {
                    "http_in": int(med(lambda r: r["proxy"]["http"]["in"])),
                    "http_out": int(med(lambda r: r["proxy"]["http"]["out"])),
                    "store_in": int(med(lambda r: r["proxy"]["store"]["in"])),
                    "store_out": int(med(lambda r: r["proxy"]["store"]["out"])),
                    "http_connections": int(med(lambda r: r["proxy"]["http"]["connections"])),
                    "store_connections": int(med(lambda r: r["proxy"]["store"]["connections"])),
                    "total": int(
                        med(
                            lambda r: sum(
                                r["proxy"][k][d] for k in ("http", "store") for d in ("in", "out")
                            )
                        )
                    ),
                }
                if proxied
                else None
            ),
            "collective_bytes_per_worker": int(
                med(lambda r: statistics.median(r["worker_collective_bytes"]))
            ),
            "server_status_bytes": {
                "in": int(med(lambda r: r["server_status_bytes_in"])),
                "out": int(med(lambda r: r["server_status_bytes_out"])),
            },
            "all_rounds_ok": all(
                r["consistent"]
                and r["failed_syncs"] == 0
                and r["discarded"] == 0
                and all(x == 1 for x in r["worker_rounds"])
                for r in self.rounds
            ),
            "server": {
                "maxrss": final["maxrss"],
                "base_rss": self.hello["base_rss"],
                "polled_peak_rss": self.poller.peaks.get(self.hello["pid"], 0),
                "rounds_completed": final["status"].get("rounds_completed"),
                "rounds_discarded": final["status"].get("rounds_discarded"),
            },
            "worker": {
                "maxrss": max(d["maxrss"] for d in done.values()),
                "maxrss_each": [done[i]["maxrss"] for i in sorted(done)],
                "base_rss": max(r["base_rss"] for r in self.ready.values()),
                "rss_after_join": max(r["rss_joined"] for r in self.ready.values()),
                "polled_peak_rss": max(self.poller.peaks.get(w.pid, 0) for w in self.workers),
            },
        }

    def _stop_server(self) -> dict[str, Any]:
        self.conn.send("stop")
        if not self.conn.poll(60):
            raise TimeoutError("server did not answer stop")
        final = self.conn.recv()
        self.server.join(30)
        return final

    # --- kill mode -------------------------------------------------------------------------

    def kill_inside(self) -> dict[str, Any]:
        """Wait until every worker is inside round ``kill["round"]``'s all-reduce (the victim
        blocking there), SIGKILL the victim, wait for the survivors to finish their rounds."""
        n, args = self.n, self.args
        victim = self.workers[-1]
        wait = self.setup_timeout + args.round_timeout
        inside, late = wait_inside(self.inbox, self.victim_conn, n, wait)
        os.kill(victim.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        done = self.inbox.collect("done", n - 1, wait, "the survivors after the kill")
        final = self._stop_server()
        survivors = []
        for i in sorted(done):
            survivors.append(_after_kill(i, done[i], t_kill))
        return {
            "workers": n,
            "victim": n - 1,
            "kill_round": self.kill["round"] if self.kill else None,
            "inside_before_kill_s": {str(i): t_kill - v["t"] for i, v in sorted(inside.items())},
            "not_inside": late,
            "survivors": survivors,
            "server_rounds_completed": final["status"].get("rounds_completed"),
            "server_rounds_discarded": final["status"].get("rounds_discarded"),
            "worker_maxrss": [done[i]["maxrss"] for i in sorted(done)],
            "logs": {  # each survivor's syncs, times in s after the kill
                str(i): [
                    {
                        "round": e["round"],
                        "start": e["t0"] - t_kill,
                        "end": e["t1"] - t_kill,
                        "discarded": e["delta"].get("discarded_rounds", 0),
                        "events": [(w, t - t_kill) for w, t in e["events"]],
                    }
                    for e in done[i]["log"]
                ]
                for i in sorted(done)
            },
        }


def wait_inside(
    inbox: Inbox, victim_conn: Any, n: int, wait: float
) -> tuple[dict[int, Any], list[str]]:
    """The victim (worker n-1) inside the kill round's all-reduce (on its own pipe), then the
    survivors (on the queue, up to the collective's own limit): who said so, and who did not."""
    if not victim_conn.poll(wait):
        raise TimeoutError("the victim never reached the all-reduce")
    inside = {n - 1: victim_conn.recv()}
    late = []
    try:
        inside.update(inbox.collect("inside", n - 1, 30, "the survivors reaching the all-reduce"))
    except TimeoutError as exc:
        late.append(str(exc))
    return inside, late


def _after_kill(idx: int, done: dict[str, Any], t_kill: float) -> dict[str, Any]:
    """One survivor's view of the kill: when its round failed, re-formed, completed."""
    log = done["log"]
    hit = next((e for e in log if e["t1"] > t_kill), None)
    out: dict[str, Any] = {"worker": idx, "rounds": len(log)}
    if hit is None:
        out["error"] = "no round ended after the kill"
        return out
    events = [(w, t) for w, t in hit["events"] if t > t_kill]

    def first(what: str, after: float = t_kill) -> float | None:
        return next((t - t_kill for w, t in events if w == what and t > after), None)

    failed = first("reported_failure")
    out.update(
        {
            "round": hit["round"],
            "discarded_in_round": hit["delta"].get("discarded_rounds", 0),
            "failed_syncs_in_round": hit["delta"].get("failed_syncs", 0),
            "failure_reported_s": failed,
            "next_quorum_s": first("quorum_reply", t_kill + (failed or 0.0)),
            "blocked_s": hit["t1"] - t_kill,  # until its next completed round
            "round_sync_s": hit["t1"] - hit["t0"],
            "later_rounds_s": [e["t1"] - e["t0"] for e in log if e["round"] > hit["round"]],
        }
    )
    return out


# --- driving ---------------------------------------------------------------------------------


def run_config(
    ctx: Any, cfg: Config, n: int, shape: ModelShape, params_path: str, args: argparse.Namespace
) -> dict[str, Any]:
    with Session(
        ctx,
        cfg,
        n,
        shape,
        params_path if cfg.mode == "server" else None,
        args,
        rounds=args.warmup + args.rounds,
    ) as s:
        for _ in range(args.warmup + args.rounds):
            s.round()
        return s.finish()


def run_kill(ctx: Any, shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    cfg = Config("allreduce", not args.kill_fp32, proxied=False)
    kill = {"round": args.kill_round, "heartbeat_interval": args.kill_heartbeat_interval}
    with Session(
        ctx,
        cfg,
        args.kill_workers,
        shape,
        None,
        args,
        rounds=args.kill_round + 1 + args.kill_after,
        heartbeat_timeout=args.kill_heartbeat_timeout,
        kill=kill,
    ) as s:
        res = s.kill_inside()
    res.update(
        {
            "config": cfg.label,
            "params": shape.numel,
            "heartbeat_timeout_s": args.kill_heartbeat_timeout,
            "heartbeat_interval_s": args.kill_heartbeat_interval,
            "collective_timeout_s": args.collective_timeout,
        }
    )
    return res


def _x(b: float, model: int) -> str:
    return f"{fmt_mb(b)} ({b / model:.2f}x)"


def _kb(b: float) -> str:
    return f"{b / 1e3:,.1f} KB" if b < 1e6 else f"{fmt_mb(b)} MB"


def print_round_tables(results: list[dict[str, Any]], model_bytes: int) -> None:
    print_table(
        [
            "N",
            "config",
            "round s median (min-max)",
            "bytes through server per round: in / out (store in / out)",
            "server /status body bytes in / out",
            "payload averaged per worker MB",
            "server peak RSS MB (x model)",
            "worker peak RSS MB (x model)",
            "worker peak above torch base (x model)",
            "rounds ok",
        ],
        [
            [
                str(d["workers"]),
                d["config"],
                f"{d['round_s']['median']:.2f} ({d['round_s']['min']:.2f}-{d['round_s']['max']:.2f})",
                (
                    "-"
                    if d["server_bytes"] is None
                    else f"{_kb(d['server_bytes']['http_in'] + d['server_bytes']['store_in'])} / "
                    f"{_kb(d['server_bytes']['http_out'] + d['server_bytes']['store_out'])} "
                    f"({_kb(d['server_bytes']['store_in'])} / "
                    f"{_kb(d['server_bytes']['store_out'])})"
                ),
                f"{_kb(d['server_status_bytes']['in'])} / {_kb(d['server_status_bytes']['out'])}",
                fmt_mb(d["collective_bytes_per_worker"])
                if d["collective_bytes_per_worker"]
                else "-",
                _x(d["server"]["maxrss"], model_bytes),
                _x(d["worker"]["maxrss"], model_bytes),
                f"{(d['worker']['maxrss'] - d['worker']['base_rss']) / model_bytes:.2f}x",
                "yes" if d["all_rounds_ok"] else "NO",
            ]
            for d in results
        ],
    )
    ar = [d for d in results if d["mode"] == "allreduce" and d["phases_median"]]
    if ar:
        keys = list(ar[0]["phases_median"])
        print("\nWhere an all-reduce round goes (s; per round the median over workers, then the")
        print("median over rounds; quorum_wait includes waiting for the last worker to ask):")
        print_table(
            ["N", "config", *keys],
            [
                [str(d["workers"]), d["config"], *(f"{d['phases_median'][k]:.3f}" for k in keys)]
                for d in ar
            ],
        )
    print("\nCPU seconds per round (medians; server process, all workers, the proxy):")
    print_table(
        ["N", "config", "server", "workers", "proxy"],
        [
            [
                str(d["workers"]),
                d["config"],
                f"{d['cpu_s_median']['server']:.2f}",
                f"{d['cpu_s_median']['workers']:.2f}",
                f"{d['cpu_s_median'].get('proxy', float('nan')):.2f}",
            ]
            for d in results
        ],
    )


def print_kill(res: dict[str, Any]) -> None:
    print(
        f"\nKill inside the all-reduce ({res['config']}, {res['workers']} workers, "
        f"{res['params']:,} params; heartbeat timeout {res['heartbeat_timeout_s']:g} s, "
        f"heartbeats every {res['heartbeat_interval_s']:g} s, collective timeout "
        f"{res['collective_timeout_s']:g} s); seconds after the SIGKILL:"
    )

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    print_table(
        [
            "survivor",
            "round failed, reported discarded",
            "next quorum formed",
            "round completed (blocked)",
            "that sync took in all",
            "later rounds s",
        ],
        [
            [
                str(s["worker"]),
                f(s.get("failure_reported_s")),
                f(s.get("next_quorum_s")),
                f(s.get("blocked_s")),
                f(s.get("round_sync_s")),
                ", ".join(f"{x:.2f}" for x in s.get("later_rounds_s", [])) or "-",
            ]
            for s in res["survivors"]
        ],
    )
    print(
        f"server: rounds completed {res['server_rounds_completed']}, discarded "
        f"{res['server_rounds_discarded']}; all inside the all-reduce "
        f"{'yes' if not res['not_inside'] else 'NO: ' + '; '.join(res['not_inside'])}"
    )


def add_args(ap: argparse.ArgumentParser) -> None:
    """Options shared with torchft_diloco.py."""
    ap.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    ap.add_argument("--max-dim", type=int, default=2048, help="widest square layer (default 2048)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument(
        "--collective-timeout", type=float, default=30.0, help="ServerConfig, s (default 30)"
    )
    ap.add_argument("--setup-timeout", type=float, default=180.0, help="s (+15 per worker)")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="s per round")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round")
    ap.add_argument("--kill", action="store_true", help="also measure a kill inside the all-reduce")
    ap.add_argument("--kill-params", type=float, help="model of the kill run (default --params)")
    ap.add_argument("--kill-workers", type=int, default=3, help="workers of the kill run")
    ap.add_argument("--kill-round", type=int, default=2, help="round whose all-reduce is hit")
    ap.add_argument("--kill-after", type=int, default=2, help="rounds after that one")
    ap.add_argument("--kill-heartbeat-timeout", type=float, default=5.0, help="s (default 5)")
    ap.add_argument("--kill-heartbeat-interval", type=float, default=1.0, help="s (default 1)")
    ap.add_argument("--kill-fp32", action="store_true", help="kill run with fp32 communication")
    ap.add_argument("--kill-repeats", type=int, default=3, help="kill runs (default 3)")
    ap.add_argument(
        "--src",
        metavar="DIR",
        help="import diloco from this src/ dir in every child (e.g. a `git archive HEAD src` "
        "snapshot, so that edits to the working tree during a run cannot reach it)",
    )


def use_src(src: str | None) -> dict[str, Any]:
    """Put ``src`` first on the path the spawned children inherit (the parent never imports
    diloco), and say which code the run measures: for a snapshot, the commit named in a
    ``COMMIT`` file beside it (``git archive`` writes none; see the module docstring), for the
    checkout, its HEAD and the files of src/ that differ from it."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if src:
        where = os.path.abspath(src)
        sys.path.insert(0, where)
        info: dict[str, Any] = {"src": where}
        marker = os.path.join(os.path.dirname(where), "COMMIT")
        if os.path.exists(marker):
            with open(marker) as f:
                info["commit"] = f.read().strip()
        return info
    info = {"src": os.path.join(repo, "src")}
    try:
        git = ["git", "-C", repo]
        info["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "src"], capture_output=True, text=True
        ).stdout.split("\n")
        info["working_tree_changes_in_src"] = [x for x in changed if x.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def fits(need: int, what: str, force: bool) -> str | None:
    avail = psutil.virtual_memory().available
    if need > avail - 2**30 and not force:
        return (
            f"{what}: skipped, needs about {need / 2**30:.1f} GiB, "
            f"{avail / 2**30:.1f} GiB available (use a smaller --params, or --force)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    ap.add_argument("--allreduce-fp32", action="store_true", help="also all-reduce in fp32")
    ap.add_argument("--no-server-mode", action="store_true", help="all-reduce mode only")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="also run the server mode without the proxy (what relaying its GBs costs; the "
        "all-reduce mode's few KB cost nothing measurable)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    configs = [] if args.no_server_mode else [Config("server", True)]
    configs.append(Config("allreduce", True))
    if args.allreduce_fp32:
        configs.append(Config("allreduce", False))
    if args.direct and not args.no_server_mode:
        configs.insert(1, Config("server", True, proxied=False))
    code = use_src(args.src)
    info = machine_info()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(
        f"{started}; model: {shape.layers} x Linear({shape.dim}, {shape.dim}, bias=False) = "
        f"{shape.numel:,} params, {fmt_mb(model_bytes)} MB fp32; configurations "
        f"{', '.join(c.label for c in configs)}; rounds {args.warmup} warm-up + {args.rounds} "
        "measured",
        flush=True,
    )
    print(f"machine: {info['nproc']} CPUs, {info['ram_gib']} GiB RAM, {info['cpu']}", flush=True)
    print(f"code: {code}", flush=True)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="allreduce-bench-")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    kill: list[dict[str, Any]] | None = None
    try:
        params_path = os.path.join(tmp, "init.safetensors")
        if not args.no_server_mode:
            writer = ctx.Process(target=write_params_main, args=(params_path, shape), daemon=True)
            try:
                writer.start()
                writer.join(args.setup_timeout)
                if writer.exitcode != 0:
                    raise RuntimeError(f"writing the initial parameters failed ({writer.exitcode})")
            finally:
                reap([writer])
        for n in sorted(set(args.workers)):
            for cfg in configs:
                tag = f"N={n} {cfg.label}"
                msg = fits(estimate_bytes(n, model_bytes, cfg), tag, args.force)
                if msg:
                    print(msg, flush=True)
                    skipped.append(msg)
                    continue
                print(f"{tag} ...", flush=True)
                t = time.monotonic()
                d = run_config(ctx, cfg, n, shape, params_path, args)
                sb = d["server_bytes"]
                print(
                    f"{tag}: round median {d['round_s']['median']:.3f} s; phases "
                    f"{d['phases_median']}; through the server per round "
                    + ("-" if sb is None else f"{sb['total']:,} B")
                    + f"; worker peak {fmt_mb(d['worker']['maxrss'])} MB; "
                    f"took {time.monotonic() - t:.0f} s",
                    flush=True,
                )
                results.append(d)
        if args.kill:
            kshape = choose_shape(args.kill_params or args.params, args.max_dim)
            cfg = Config("allreduce", not args.kill_fp32, proxied=False)
            msg = fits(estimate_bytes(args.kill_workers, kshape.nbytes, cfg), "kill", args.force)
            if msg:
                print(msg, flush=True)
                skipped.append(msg)
            else:
                kill = []
                for i in range(args.kill_repeats):
                    print(
                        f"kill run {i + 1}/{args.kill_repeats}: {args.kill_workers} workers, "
                        f"{kshape.numel:,} params ...",
                        flush=True,
                    )
                    kill.append(run_kill(ctx, kshape, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    if results:
        print_round_tables(results, model_bytes)
        print(
            "\nBytes through the server: TCP payload counted by a relay in front of the "
            "server's HTTP port and (all-reduce) its rendezvous store; MB = 10**6 B, KB = 10**3 B. "
            f"Model = {fmt_mb(model_bytes)} MB fp32."
        )
    for k in kill or []:
        print_kill(k)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "allreduce_round",
                "date": started,
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "machine": info,
                "code": code,
                "model": {**asdict(shape), "numel": shape.numel, "fp32_bytes": model_bytes},
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "round_definition": "max over workers of force_sync() end - min over workers "
                "of its start, after a barrier (zero inner-step time)",
                "results": results,
                "kill": kill,
                "skipped": skipped,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
