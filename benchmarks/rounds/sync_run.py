"""The parent's side of the sync-round benchmark's DiLoCo rounds: ``DiLoCoRun``.

It starts the server process and N worker processes (``sync_children``), then drives them
one round at a time, so that ``sync_round.run_pair`` can put a raw-socket round beside each one.
It asks the server for its status between rounds: the byte counters then bracket one round. A
round's wall time runs from the earliest worker start after the barrier to the last adoption
(``time.monotonic`` is one system-wide clock on Linux, so stamps from different processes compare).
Its ``Comm`` says how rounds travel: the workers' upload codec and the server's download codec.
The bytes it reports are measured (the workers' counters around each sync, the server's status
between rounds), never computed from the codecs.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.harness.model import ModelShape
from benchmarks.harness.processes import start_profilers, stop_profilers
from benchmarks.harness.report import cpu_median, summary
from benchmarks.harness.server_child import server_main
from benchmarks.harness.session import SessionRun
from benchmarks.rounds.sync_children import Comm, worker_main


class DiLoCoRun(SessionRun):
    """A server process and N worker processes (a ``Session``), driven one round at a time."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        shape: ModelShape,
        params_path: str,
        args: argparse.Namespace,
        comm: Comm,
    ) -> None:
        super().__init__(ctx, n, args, rounds=args.warmup + args.rounds)
        self.shape, self.params_path, self.comm = shape, params_path, comm
        self._profilers: list[Any] = []

    def __exit__(self, *exc: object) -> None:
        stop_profilers(self._profilers)
        super().__exit__()

    def _server_config(self) -> dict[str, Any]:
        codec = self.comm.down
        rule = getattr(self.args, "outer_rule", None) or (
            "sparseloco" if codec == "sparse" else None
        )
        return {
            "num_workers": self.n,
            "initial_params": self.params_path,
            # The benchmark's workers send no heartbeats; setup of 16 workers can take minutes.
            "heartbeat_timeout": 0,
            "stuck_timeout": 0,
            # Durable rounds: each checkpoint written before its round is sent (keep 1: one on
            # disk; a temporary save dir is made when saving).
            "save_every": self.args.save_every,
            "keep_checkpoints": 1,
            # Named only when compressed, so that a --server-src checkout from before codecs
            # still runs.
            **({"download_codec": codec} if codec != "fp32" else {}),
            # The sparse downlink needs plain averaged descent; --outer-rule sets it for all.
            **({"outer_rule": rule} if rule is not None else {}),
        }

    def _start(self) -> None:
        args, s = self.args, self.session
        self.hello = s.start_hub(
            server_main,
            (self._server_config(), args.server_threads, args.server_src),
            "diloco-server",
            env=args.server_env,
        )
        # Workers only (``finished``): a worker that has adopted the new parameters waits for
        # the others before its checksum and the next round's perturbation, so that benchmark
        # bookkeeping never competes for the cores with a download still in progress.
        self.ready = s.start_members(
            worker_main,
            lambda i: (
                self.hello["address"],
                self.shape,
                self.comm.up,
                self.total_rounds,
                s.barrier,
                s.finished,
                self.setup_timeout + args.round_timeout,  # the first wait spans setup
                (args.warmup, args.cprofile) if getattr(args, "cprofile", None) else None,
            ),
            "worker",
        )
        self.workers = s.members
        self.status = self._server_status()

    def settle(self) -> None:
        """Wait until every worker has done its between-round work (checksum, perturbation) and
        sits idle at the start barrier, so that nothing of it overlaps a raw round."""
        self.session.settle()

    def _server_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.session.call_hub("status")
        return status

    def round(self) -> dict[str, Any]:
        n, args, s = self.n, self.args, self.session
        r = len(self.rounds)
        s.check(f"N={n} round {r}")
        s.settle()
        if args.profile and r == args.warmup:
            self._profilers = start_profilers(
                args.profile, n, {"server": self.hello["pid"], "worker0": self.workers[0].pid}
            )
        msgs, cpu = s.run_round(f"N={n} round {r}")
        if r == self.total_rounds - 1:
            stop_profilers(self._profilers)
            self._profilers = []
        new_status = self._server_status()
        status = self.status
        t0 = min(m["t0"] for m in msgs.values())
        t1 = max(m["t1"] for m in msgs.values())
        sub = [m["submitted"] for m in msgs.values()]
        body = [m["body"] for m in msgs.values()]
        phases = None
        if None not in sub and None not in body:
            phases = {
                "uploads_s": max(sub) - t0,  # until the last upload was answered
                "close_s": max(0.0, min(body) - max(sub)),  # until the first download began
                "downloads_s": t1 - max(max(sub), min(body)),  # until the last worker adopted
            }
        deltas = [m["delta"] for m in msgs.values()]
        checksums = {m["checksum"] for m in msgs.values()}
        server_rounds = {m["server_round"] for m in msgs.values()}
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "t0": t0,
            "wall_s": t1 - t0,
            "start_spread_s": max(m["t0"] for m in msgs.values()) - t0,
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": cpu,
            "phases": phases,
            "worker_bytes_up": [d["bytes_up"] for d in deltas],
            "worker_bytes_down": [d["bytes_down"] for d in deltas],
            "worker_rounds": [d["rounds"] for d in deltas],
            "worker_update_downloads": [d.get("update_downloads", 0) for d in deltas],
            "worker_full_downloads": [d.get("full_downloads", 0) for d in deltas],
            "failed_syncs": sum(d["failed_syncs"] for d in deltas),
            "retries": sum(d["retries"] for d in deltas),
            "server_bytes_in": new_status["bytes_in"] - status["bytes_in"],
            "server_bytes_out": new_status["bytes_out"] - status["bytes_out"],
            # The server's own count of the round's bytes each way (None from a server before
            # codecs, --server-src): a check on the counters' difference above.
            "server_last_round_bytes_in": new_status.get("last_round_bytes_in"),
            "server_last_round_bytes_out": new_status.get("last_round_bytes_out"),
            "server_update_downloads": new_status.get("update_downloads", 0)
            - status.get("update_downloads", 0),
            "server_full_downloads": new_status.get("full_downloads", 0)
            - status.get("full_downloads", 0),
            "server_round": new_status["round"],
            "server_contributions": new_status["last_round_contributions"],
            "server_last_round_time_s": new_status["last_round_time_s"],
            "consistent": len(checksums) == 1 and len(server_rounds) == 1,
        }
        self.rounds.append(result)
        self.status = new_status
        if args.verbose:
            print(f"    N={n} round {r}: {result['wall_s']:.3f} s {phases}", flush=True)
        return result

    def bytes_per_worker(self, measured: bool = False) -> tuple[int, int]:
        """Upload and download bytes of one worker's sync (median over the rounds so far, or
        over the measured ones: a compressed downlink's first round may differ)."""
        rounds = [r for r in self.rounds if not (measured and r["warmup"])]
        up = statistics.median(b for r in rounds for b in r["worker_bytes_up"])
        down = statistics.median(b for r in rounds for b in r["worker_bytes_down"])
        return int(up), int(down)

    def finish(self) -> dict[str, Any]:
        n, s = self.n, self.session
        done = s.finish_members("worker shutdown")
        final = s.stop_hub()
        s.join_members()
        server_polled = s.poller.peaks.get(self.hello["pid"], 0)
        rounds = self.rounds
        measured = [r for r in rounds if not r["warmup"]]
        up, down = self.bytes_per_worker(measured=True)
        last_in = [r["server_last_round_bytes_in"] for r in measured]
        last_out = [r["server_last_round_bytes_out"] for r in measured]
        return {
            "workers": n,
            "comm": self.comm.label,
            "codec_up": self.comm.up,
            "download_codec": self.comm.down,
            "rounds": rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "cpu_s_median": cpu_median(rounds),
            "phases_median": (
                {
                    k: statistics.median(r["phases"][k] for r in measured)
                    for k in ("uploads_s", "close_s", "downloads_s")
                }
                if all(r["phases"] for r in measured)
                else None
            ),
            "upload_bytes_per_worker": up,
            "download_bytes_per_worker": down,
            "server_bytes_in_per_round": int(
                statistics.median(r["server_bytes_in"] for r in measured)
            ),
            "server_bytes_out_per_round": int(
                statistics.median(r["server_bytes_out"] for r in measured)
            ),
            "server_last_round_bytes_in": (
                None if None in last_in else int(statistics.median(last_in))
            ),
            "server_last_round_bytes_out": (
                None if None in last_out else int(statistics.median(last_out))
            ),
            # Worker syncs over the measured rounds whose new parameters came as an update of
            # the previous round (a compressed downlink), and as full parameters.
            "update_downloads": sum(sum(r["worker_update_downloads"]) for r in measured),
            "full_downloads": sum(sum(r["worker_full_downloads"]) for r in measured),
            "worker_syncs": n * len(measured),
            "all_rounds_ok": all(
                r["consistent"]
                and r["failed_syncs"] == 0
                and all(x == 1 for x in r["worker_rounds"])
                and r["server_contributions"] == n
                for r in rounds
            ),
            "retries": sum(r["retries"] for r in rounds),
            "server": {
                "maxrss": final["maxrss"],
                "polled_peak_rss": server_polled,
                "base_rss": self.hello["base_rss"],
                "rss_after_load": self.hello["rss_loaded"],
                "rss_end": final["rss_end"],
            },
            "worker": s.member_memory(done),
        }
