"""The parent's side of ``allreduce_round``: a configuration's run, ``ConfigRun``.

A configuration (``Config``) is a mode (the parameter server, or all-reduce: the server only
forms quorums and the workers average among themselves), its communication (bf16 or fp32) and
whether the server sits behind a counting proxy. ``ConfigRun`` starts the server child
(``harness.server_child``) and N worker children (``allreduce_children``) as a
``harness.session.Session`` and drives them one round at a time, reading the proxy's byte
counts and the server's status around each round; or, in a kill run, lets the workers sync
back to back and SIGKILLs one of them inside a chosen round's all-reduce.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

import psutil

from benchmarks.harness.counting_proxy import CountingProxy, diff
from benchmarks.harness.model import ModelShape
from benchmarks.harness.processes import cpu_s
from benchmarks.harness.report import summary
from benchmarks.harness.server_child import server_main
from benchmarks.harness.session import SessionRun, median_phases
from benchmarks.rounds.allreduce_children import worker_main

OVERHEAD = 350 * 2**20  # an interpreter with torch and diloco imported


@dataclass(frozen=True)
class Config:
    mode: str  # "server" or "allreduce"
    bf16: bool
    proxied: bool = True
    codec: str | None = None  # the workers' codec when not bf16/fp32 ("int8", "int4")

    @property
    def comm(self) -> str:
        return self.codec or ("bf16" if self.bf16 else "fp32")

    @property
    def label(self) -> str:
        return f"{self.mode} {self.comm}" + ("" if self.proxied else " (direct)")


def estimate_bytes(n: int, model_bytes: int, cfg: Config) -> int:
    """Expected peak of a configuration: server mode, the server ~4.5 models and each worker ~3;
    all-reduce mode, a small server and each worker ~4 models (~6 with int8/int4: the
    error-feedback residual and the round's new one); an interpreter each."""
    if cfg.mode == "server":
        return int(4.5 * model_bytes + OVERHEAD + n * (3 * model_bytes + OVERHEAD))
    if cfg.codec is not None:  # the residual and the round's new one: 2 models more
        return int(OVERHEAD + n * (6.2 * model_bytes + OVERHEAD))
    return int(OVERHEAD + n * (4.2 * model_bytes + OVERHEAD))


def config_run(
    ctx: Any, cfg: Config, n: int, shape: ModelShape, params_path: str, args: argparse.Namespace
) -> ConfigRun:
    """A round run of ``args.warmup + args.rounds`` rounds; the server loads ``params_path`` in
    server mode (all-reduce mode holds no parameters)."""
    return ConfigRun(
        ctx,
        cfg,
        n,
        shape,
        params_path if cfg.mode == "server" else None,
        args,
        rounds=args.warmup + args.rounds,
    )


class ConfigRun(SessionRun):
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
        super().__init__(ctx, n, args, rounds=rounds, kill=kill)
        self.cfg, self.shape, self.params_path = cfg, shape, params_path
        self.heartbeat_timeout = heartbeat_timeout
        self.proxy: CountingProxy | None = None

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        if self.proxy is not None:
            self.proxy.stop()

    def _server_config(self) -> dict[str, Any]:
        allreduce = self.cfg.mode == "allreduce"
        return {
            "num_workers": self.n,
            "initial_params": None if allreduce else self.params_path,
            "allreduce": allreduce,
            "heartbeat_timeout": self.heartbeat_timeout,
            "stuck_timeout": 0,
            "collective_timeout": self.args.collective_timeout,
        }

    def _start(self) -> None:
        ctx, cfg, args, s = self.ctx, self.cfg, self.args, self.session
        if cfg.proxied:
            self.proxy = CountingProxy(ctx, ["http", "store"])
            self.proxy_proc = psutil.Process(self.proxy.proc.pid)
        store_proxy = self.proxy.address("store") if self.proxy is not None else None
        self.hello = s.start_hub(
            server_main,
            (self._server_config(), args.server_threads, None, store_proxy),
            "diloco-server",
        )
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
        self.ready = s.start_members(
            worker_main,
            lambda i: (address, self.shape, cfg.mode, cfg.comm, *self.pace_of(i)),
            "worker",
        )

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.session.call_hub("status")
        return status

    def _counts(self) -> dict[str, Any]:
        return self.proxy.counts() if self.proxy is not None else {}

    # --- round mode ------------------------------------------------------------------------

    def round(self) -> dict[str, Any]:
        n, args, s = self.n, self.args, self.session
        r = len(self.rounds)
        what = f"N={n} {self.cfg.label} round {r}"
        s.check(what)
        s.settle()  # every worker idle at the barrier now
        status0, counts0 = self.status(), self._counts()
        proxy_cpu0 = cpu_s(self.proxy_proc) if self.proxy is not None else 0.0
        msgs, cpu = s.run_round(what)
        counts = diff(self._counts(), counts0) if self.proxy is not None else None
        if self.proxy is not None:
            cpu["proxy"] = cpu_s(self.proxy_proc) - proxy_cpu0
        status1 = self.status()
        t0 = min(m["t0"] for m in msgs.values())
        t1 = max(m["t1"] for m in msgs.values())
        deltas = [m["delta"] for m in msgs.values()]
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "wall_s": t1 - t0,
            "start_spread_s": max(m["t0"] for m in msgs.values()) - t0,
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": cpu,
            "phases": median_phases([m["phases"] for m in msgs.values()]),
            "proxy": counts,
            "server_status_bytes_in": status1["bytes_in"] - status0["bytes_in"],
            "server_status_bytes_out": status1["bytes_out"] - status0["bytes_out"],
            "worker_client_bytes_up": [d.get("bytes_up", 0) for d in deltas],
            "worker_client_bytes_down": [d.get("bytes_down", 0) for d in deltas],
            # All-reduce mode (from 3237867 on): the payload each worker averaged.
            "worker_collective_bytes": [d.get("collective_bytes", 0) for d in deltas],
            # From issue 30 on: each worker's bytes to and from the other members.
            "worker_collective_sent": [d.get("collective_sent", 0) for d in deltas],
            "worker_collective_received": [d.get("collective_received", 0) for d in deltas],
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
        n, s = self.n, self.session
        done = s.finish_members("worker shutdown")
        final = s.stop_hub()
        measured = [r for r in self.rounds if not r["warmup"]]

        def med(f: Any) -> float:
            return statistics.median(f(r) for r in measured)

        proxied = self.proxy is not None
        return {
            "config": self.cfg.label,
            "mode": self.cfg.mode,
            "comm": self.cfg.comm,
            "proxied": proxied,
            "workers": n,
            "rounds": self.rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "phases_median": median_phases([r["phases"] for r in measured]),
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
            "collective_sent_per_worker": int(
                med(lambda r: statistics.median(r["worker_collective_sent"]))
            ),
            "collective_received_per_worker": int(
                med(lambda r: statistics.median(r["worker_collective_received"]))
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
                "polled_peak_rss": s.poller.peaks.get(self.hello["pid"], 0),
                "rounds_completed": final["status"].get("rounds_completed"),
                "rounds_discarded": final["status"].get("rounds_discarded"),
            },
            "worker": s.member_memory(done),
        }

    # --- kill mode -------------------------------------------------------------------------

    def kill_inside(self) -> dict[str, Any]:
        """Kill the victim inside round ``kill["round"]``'s all-reduce (``kill_victim``), wait
        for the survivors to finish their rounds."""
        k = self.kill_victim()
        final = self.session.stop_hub()
        t_kill, done = k.t_kill, k.done
        return {
            "workers": self.n,
            "victim": self.n - 1,
            "kill_round": self.kill["round"] if self.kill else None,
            "inside_before_kill_s": k.inside_before_kill_s,
            "not_inside": k.not_inside,
            "survivors": [_after_kill(i, done[i], t_kill) for i in sorted(done)],
            "server_rounds_completed": final["status"].get("rounds_completed"),
            "server_rounds_discarded": final["status"].get("rounds_discarded"),
            "worker_maxrss": k.worker_maxrss,
            "logs": k.logs(
                lambda e: {
                    "discarded": e["delta"].get("discarded_rounds", 0),
                    "events": [(w, t - t_kill) for w, t in e["events"]],
                }
            ),
        }


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


def add_args(ap: argparse.ArgumentParser) -> None:
    """Options of ``allreduce_round``, shared with ``torchft_diloco``."""
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
