"""Server mode against all-reduce mode on shaped links (issue 19), each party in a network namespace.

A user-space shaping proxy (``harness/shaped_links.py``) can only stand in front of the server; in the
all-reduce mode gloo connects the workers to each other directly, so here the links are real
(virtual) network links, shaped by the kernel:

* one network namespace per worker (``dlnl-w0`` ...) and one for the server (``dlnl-srv``), each
  joined by a veth pair to a bridge in a namespace of its own (``dlnl-hub``), addresses
  10.77.0.1 (server) and 10.77.0.11+i (worker i) on 10.77.0.0/24. Nothing is created in the root
  namespace, so its interfaces (``eth0``, ``lo``, ...) are never touched;
* every link shaped to ``--rate-mb`` MB/s (MB = 10**6 bytes, on the wire: Ethernet, IP and TCP
  headers included) in each direction by a ``tbf`` qdisc on the egress of both ends of its veth
  (the namespace end shapes what it sends, the hub end what it receives), optionally with
  ``--delay-ms`` of one-way delay (``netem`` under the ``tbf``);
* before the runs, plain sockets check the links: one worker's link carries the rate each way at
  once, two workers sending to the server share its one link, and a worker-to-worker path (the
  all-reduce's) carries the rate.

Each process of ``allreduce_round``'s runs (its ``ConfigRun``, a ``harness.session.Session``: a
server child and N worker children driven one round at a time through barriers) is started
inside its namespace (``netns.py`` builds them): ``NetnsContext`` wraps the ``multiprocessing`` context so that
each child joins its namespace (``setns(2)``, what ``ip netns exec`` does) before it imports
anything. The server binds the server namespace's address; an all-reduce worker's gloo device
binds the address of its route to the server, its own namespace's.

Configurations, each on a fresh server and fresh workers, for every N in ``--workers``:
``server bf16`` (bf16 pseudo-gradients up, fp32 parameters down: the default), ``server fp32``
(``--server-fp32``), ``allreduce fp32`` and ``allreduce bf16`` (``ServerConfig(allreduce=True)``;
the server only forms quorums). A round is ``allreduce_round``'s: the slowest worker's
``force_sync()`` after a barrier, no inner steps. Medians over the rounds after the warm-up (the
first round after the join). Bytes on the links are read from the ``tbf`` counters around each
round.

Wire time of a round, P parameters, rate R, N workers:

* server mode: every upload (P x 2 bytes in bf16, x 4 in fp32) passes the server's one link, then
  every download (P x 4 bytes); the downloads cannot start before the last upload is in (a
  synchronous round), so the wire time is N x up / R + N x down / R. Were the two directions
  overlapped (pipelined rounds), max(N x up, N x down) / R would be the bound; it is shown too;
* all-reduce mode (a ring: reduce-scatter, then all-gather): each worker sends and receives
  2 (N-1) / N x payload over its own link, payload = P x 4 (fp32) or P x 2 (bf16) bytes.

Run it as root (namespaces, veths and qdiscs need CAP_NET_ADMIN), from the repository root::

    python -m benchmarks.links.netns_links --quick     # tiny model, N=2, 1 round: does it work?
    python -m benchmarks.links.netns_links --params 25e6 --workers 2 4 8 --rounds 4 --server-fp32 \\
        --json benchmarks/results/netns_links_25M.json | tee benchmarks/results/netns_links_25M.txt

``--smoke`` is ``--quick`` with checks; where namespaces cannot be made (not root, no ``ip``),
it says so and runs the same configurations on loopback instead.

Children import ``diloco`` from the parent's ``sys.path`` and ``PYTHONPATH`` (set
``PYTHONPATH=src`` to measure this checkout's code). Namespaces left by an earlier run that died
are removed at the start; everything is removed at the end, on Ctrl-C and on errors too
(``--cleanup`` only removes them). One run at a time (a lock file).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import multiprocessing as mp
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.model import ModelShape, choose_shape, write_params
from benchmarks.harness.report import (
    MB,
    fmt_mb,
    machine_info,
    now,
    ok,
    print_machine,
    print_table,
    run_head,
    spread,
    summary,
    write_json,
)
from benchmarks.harness.rss import skipped_for_memory
from benchmarks.harness.source import use_src
from benchmarks.links.netns import (
    SERVER_NS,
    NetnsContext,
    Topology,
    check_links,
    sh,
    take_lock,
    teardown,
    unavailable,
    worker_ns,
)
from benchmarks.rounds.allreduce_round import print_phases
from benchmarks.rounds.allreduce_run import Config, config_run, estimate_bytes

# --- the diloco rounds ------------------------------------------------------------------------


def wire_seconds(cfg: Config, n: int, params: int, rate_mb: float) -> dict[str, float]:
    """The time the round's payload needs on the links (module docstring)."""
    rate = rate_mb * MB
    if cfg.mode == "server":
        up, down = params * (2 if cfg.bf16 else 4), params * 4
        return {
            "wire_s": n * (up + down) / rate,
            "wire_overlapped_s": max(n * up, n * down) / rate,
            "payload_per_worker_up": up,
            "payload_per_worker_down": down,
        }
    payload = params * (2 if cfg.bf16 else 4)
    ring = 2 * (n - 1) / n * payload
    return {
        "wire_s": ring / rate,
        "wire_overlapped_s": ring / rate,
        "payload_per_worker_up": ring,
        "payload_per_worker_down": ring,
    }


def run_config(
    ctx: Any,
    topo: Topology | None,
    cfg: Config,
    n: int,
    shape_: ModelShape,
    params_path: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One configuration on a fresh server and N fresh workers: ``ConfigRun``'s rounds, with the
    bytes each link carried read from the qdisc counters around every round (not without a
    topology: a smoke run on loopback)."""
    with config_run(ctx, cfg, n, shape_, params_path, args) as s:
        links = []
        for _ in range(s.total_rounds):
            before = topo.link_bytes() if topo is not None else {}
            s.round()
            after = topo.link_bytes() if topo is not None else {}
            links.append(
                {ns: [a - b for a, b in zip(after[ns], before[ns], strict=True)] for ns in after}
            )
        d = s.finish()
    measured = [lk for lk, r in zip(links, d["rounds"], strict=True) if not r["warmup"]]
    workers = [worker_ns(i) for i in range(n)]
    d["link_bytes_median"] = (
        None
        if topo is None
        else {
            "server_in": statistics.median(lk[SERVER_NS][1] for lk in measured),
            "server_out": statistics.median(lk[SERVER_NS][0] for lk in measured),
            "worker_up": statistics.median(
                statistics.mean(lk[w][0] for w in workers) for lk in measured
            ),
            "worker_down": statistics.median(
                statistics.mean(lk[w][1] for w in workers) for lk in measured
            ),
        }
    )
    d["worker_sync_s"] = summary(
        [statistics.median(r["worker_sync_s"]) for r in d["rounds"] if not r["warmup"]]
    )
    d["wire"] = wire_seconds(cfg, n, shape_.numel, args.rate_mb)
    d["ratio"] = d["round_s"]["median"] / d["wire"]["wire_s"]
    d["link_bytes_per_round"] = links
    return d


# --- reporting --------------------------------------------------------------------------------


def print_links(checks: list[dict[str, Any]], rate_mb: float) -> None:
    print(f"\nLink check, plain TCP (payload MB/s; the links carry {rate_mb:g} MB/s of frames):")
    print_table(
        ["check", "each flow MB/s", "together MB/s"],
        [
            [
                c["check"],
                " / ".join(f"{r:.1f}" for r in c["per_flow_mb_s"]),
                "-" if c["together_mb_s"] is None else f"{c['together_mb_s']:.1f}",
            ]
            for c in checks
        ],
    )


def _pair(counts: dict[str, float] | None, a: str, b: str) -> str:
    return "-" if counts is None else f"{fmt_mb(counts[a])} / {fmt_mb(counts[b])}"


def print_results(results: list[dict[str, Any]]) -> None:
    print("\nRounds on the shaped links (s; medians over the measured rounds):")
    print_table(
        [
            "mode",
            "comm",
            "N",
            "round s (min-max)",
            "wire s",
            "round / wire",
            "wire s if up and down overlapped",
            "server link MB in / out",
            "worker link MB up / down",
            "rounds ok",
        ],
        [
            [
                d["mode"],
                d["comm"]
                + (" up, fp32 down" if d["mode"] == "server" and d["comm"] == "bf16" else ""),
                str(d["workers"]),
                spread(d["round_s"]),
                f"{d['wire']['wire_s']:.2f}",
                f"{d['ratio']:.2f}",
                f"{d['wire']['wire_overlapped_s']:.2f}",
                _pair(d["link_bytes_median"], "server_in", "server_out"),
                _pair(d["link_bytes_median"], "worker_up", "worker_down"),
                ok(d["all_rounds_ok"]),
            ]
            for d in results
        ],
    )
    print_phases(
        results,
        "comm",
        "\nWhere an all-reduce round goes (s; median over workers, then over rounds):",
    )
    print("\nCPU seconds per round (medians; the server process, all workers together):")
    print_table(
        ["mode", "comm", "N", "server", "workers"],
        [
            [
                d["mode"],
                d["comm"],
                str(d["workers"]),
                f"{d['cpu_s_median']['server']:.2f}",
                f"{d['cpu_s_median']['workers']:.2f}",
            ]
            for d in results
        ],
    )


# --- main ---------------------------------------------------------------------------------------


def lscpu_model() -> str:
    """The CPU model as ``lscpu`` names it."""
    for line in sh("lscpu", check=False).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (default 25e6)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not measured (default 1)")
    ap.add_argument("--rate-mb", type=float, default=50.0, help="link rate, MB/s each way")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link, ms")
    ap.add_argument("--server-fp32", action="store_true", help="also the server mode in fp32")
    ap.add_argument("--no-allreduce-bf16", action="store_true", help="all-reduce in fp32 only")
    ap.add_argument("--check-mb", type=float, default=100.0, help="MB per flow of the link check")
    ap.add_argument("--no-check", action="store_true", help="skip the link check")
    ap.add_argument("--links-only", action="store_true", help="the link check only")
    ap.add_argument("--max-dim", type=int, default=1024, help="widest square layer (default 1024)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--collective-timeout", type=float, default=60.0, help="ServerConfig, s")
    ap.add_argument("--setup-timeout", type=float, default=180.0, help="s (+15 per worker)")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="s per round")
    ap.add_argument("--quick", action="store_true", help="tiny model, N=2, 1 round: a smoke test")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round")
    ap.add_argument("--cleanup", action="store_true", help="only remove leftover namespaces")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.quick or args.smoke:
        args.params, args.workers, args.rounds, args.warmup = 2e5, [2], 1, 1
        args.check_mb = min(args.check_mb, 10.0)
    if args.smoke:  # one configuration of each mode
        args.server_fp32, args.no_allreduce_bf16, args.check_mb = False, True, 5.0
    if args.rounds < 1 or args.warmup < 0 or min(args.workers) < 2:
        ap.error("--rounds must be >= 1, --warmup >= 0, every N >= 2")
    return args


def smoke_on_loopback(args: argparse.Namespace) -> int:
    """A smoke run where namespaces cannot be made: the same configurations and rounds on
    loopback (no shaping, no link counters), checked."""
    shape_ = choose_shape(args.params, args.max_dim)
    ctx = mp.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory(prefix="netns-links-") as tmp:
        params_path = write_params(ctx, tmp, shape_, args.setup_timeout)
        for cfg in configs_of(args):
            results.append(run_config(ctx, None, cfg, 2, shape_, params_path, args))
    print_results(results)
    check_smoke(results, None)
    return 0


def check_smoke(results: list[dict[str, Any]], checks: list[dict[str, Any]] | None) -> None:
    """Every configuration ran consistent rounds; with namespaces, the link check saw traffic
    and the links carried the rounds' bytes."""
    smoke.require({d["mode"] for d in results} == {"server", "allreduce"}, "both modes ran")
    for d in results:
        smoke.require(d["all_rounds_ok"], f"{d['mode']} {d['comm']}: every round consistent")
        if d["link_bytes_median"] is not None:
            smoke.require(d["link_bytes_median"]["worker_up"] > 0, "the worker links carried bytes")
    if checks is not None:
        smoke.require(all(min(c["per_flow_mb_s"]) > 0 for c in checks), "the links carry bytes")
    smoke.passed("netns_links")


def configs_of(args: argparse.Namespace) -> list[Config]:
    configs = [Config("server", True, proxied=False)]
    if args.server_fp32:
        configs.append(Config("server", False, proxied=False))
    configs.append(Config("allreduce", False, proxied=False))
    if not args.no_allreduce_bf16:
        configs.append(Config("allreduce", True, proxied=False))
    return configs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None and args.smoke:
        smoke.skip("network namespaces and shaped links", why)
        return smoke_on_loopback(args)
    if why is not None:
        sys.exit(f"cannot make network namespaces here: {why}")
    lock = take_lock()
    if args.cleanup:
        teardown()
        return 0
    # Whatever ends the run (an error, Ctrl-C, SIGTERM), the namespaces go: SIGTERM becomes an
    # exception so the finally clauses run; atexit covers an exit between them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    atexit.register(teardown)

    shape_ = choose_shape(args.params, args.max_dim)
    configs = configs_of(args)
    spec = importlib.util.find_spec("diloco")  # finds, does not import (the parent stays light)
    code = use_src(None) | {"diloco_imported_from": spec.origin if spec else None}
    info = machine_info() | {"lscpu_model": lscpu_model()}
    started = now()
    print(
        f"{started}; model: {shape_.describe()}; links {args.rate_mb:g} MB/s "
        f"each way, delay {args.delay_ms:g} ms; N = {', '.join(map(str, args.workers))}; rounds "
        f"{args.warmup} warm-up + {args.rounds} measured",
        flush=True,
    )
    print_machine(info)
    print(f"code: {code}", flush=True)
    print(f"load average at start: {load()}", flush=True)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="netns-links-")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    checks = None
    loads = {"start": load()}
    try:
        with Topology(max(max(args.workers), 2), args.rate_mb, args.delay_ms) as topo:
            if not args.no_check:
                checks = check_links(int(args.check_mb * MB))
                print_links(checks, args.rate_mb)
            if not args.links_only:
                params_path = write_params(ctx, tmp, shape_, args.setup_timeout)
                for n in sorted(set(args.workers)):
                    for cfg in configs:
                        tag = f"N={n} {cfg.mode} {'bf16' if cfg.bf16 else 'fp32'}"
                        need = estimate_bytes(n, shape_.nbytes, cfg)
                        if skipped_for_memory(need, tag, args.force, skipped):
                            continue
                        t = time.monotonic()
                        d = run_config(NetnsContext(ctx), topo, cfg, n, shape_, params_path, args)
                        d["load_after"] = load()
                        print(
                            f"{tag}: round {d['round_s']['median']:.2f} s, wire "
                            f"{d['wire']['wire_s']:.2f} s; took {time.monotonic() - t:.0f} s; "
                            f"load {d['load_after']}",
                            flush=True,
                        )
                        results.append(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.close()
    loads["end"] = load()

    if results:
        print_results(results)
        print(
            f"\nWire s: the payload over {args.rate_mb:g} MB/s (server mode: N uploads, then N "
            "downloads, through the server's one link; all-reduce: 2(N-1)/N x payload per "
            "worker link). Link MB: frames counted by the tbf qdiscs (TCP/IP headers included). "
            f"Load average: {loads['start']} at the start, {loads['end']} at the end."
        )
    if args.json:
        write_json(
            args.json,
            {
                **run_head("netns_links", started, info),
                "load_average": loads,
                "code": code,
                "model": shape_.record(),
                "rate_mb_s": args.rate_mb,
                "delay_ms": args.delay_ms,
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "round_definition": "max over workers of force_sync() end - min over workers "
                "of its start, after a barrier (zero inner-step time)",
                "link_check": checks,
                "results": results,
                "skipped": skipped,
            },
        )
    if args.smoke:
        check_smoke(results, checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
