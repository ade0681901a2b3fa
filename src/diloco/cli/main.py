"""The ``diloco`` command: thin argument parsing over the library."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import secrets
import subprocess
import sys
from typing import Any

log = logging.getLogger("diloco.cli")


def _add_server(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run a DiLoCo parameter server")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8512, help="TCP port (0: any free port)")
    p.add_argument(
        "-n",
        "--num-workers",
        type=int,
        default=1,
        help="workers that must register before round 0 opens",
    )
    p.add_argument(
        "--min-workers", type=int, default=1, help="never close a round with fewer contributions"
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer SGD momentum")
    p.add_argument("--no-nesterov", action="store_true", help="plain momentum instead of Nesterov")
    p.add_argument(
        "--init",
        dest="initial_params",
        metavar="PATH",
        help="initial parameters: a .safetensors file or a folder of them (default: the first worker's)",
    )
    p.add_argument(
        "--save-dir", help="checkpoint directory; the server resumes from its newest checkpoint"
    )
    p.add_argument(
        "--save-every", type=int, default=0, help="save every N rounds (0: on shutdown only)"
    )
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--from-checkpoint", help="resume from this checkpoint directory")
    p.add_argument(
        "--fresh-start",
        action="store_true",
        help="start from scratch when --save-dir holds checkpoints of which none loads "
        "(default: refuse to start)",
    )
    p.add_argument(
        "--weighting",
        choices=("equal", "samples"),
        default="equal",
        help="average contributions equally or by the samples each worker reports",
    )
    p.add_argument(
        "--clip-norm-factor",
        type=float,
        default=None,
        metavar="C",
        help="sync: clip each upload to C x the median of the round's upload norms (robust "
        "aggregation; keeps the round's uploads: one model of memory per worker)",
    )
    p.add_argument(
        "--trim-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="sync: coordinate-wise trimmed mean dropping floor(F x n) of n values at each end "
        "(0 <= F < 0.5; 0: the weighted mean; keeps the round's uploads)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("DILOCO_TOKEN"),
        help="shared bearer token (default: $DILOCO_TOKEN; made up and printed when the server "
        "binds beyond loopback and none is given)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("DILOCO_ADMIN_TOKEN"),
        help="separate token for /control/* (default: $DILOCO_ADMIN_TOKEN; none: --token)",
    )
    p.add_argument("--tls-cert", help="PEM certificate chain: serve HTTPS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--auth-failure-limit",
        type=int,
        default=5,
        help="failed authentications per address per minute before it gets 429 (0: no limit)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=120.0,
        help="evict a worker silent this long, s (0: never)",
    )
    p.add_argument(
        "--stuck-timeout",
        type=float,
        default=1800.0,
        help="evict a worker whose loop took no step this long, s (0: never)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=15.0,
        help="drop a registered worker that fetches nothing and sends no heartbeat this long, "
        "s (0: never)",
    )
    p.add_argument(
        "--poll-timeout",
        type=float,
        default=30.0,
        help="longest a parameter long-poll waits, seconds",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="drop an upload whose sender goes quiet mid-body this long, s (0: never)",
    )
    p.add_argument(
        "--min-upload-rate",
        type=float,
        default=64 * 1024,
        help="drop an upload averaging fewer bytes/s than this over --upload-rate-window "
        "seconds of waiting for it (default 65536; 0: never)",
    )
    p.add_argument(
        "--upload-rate-window",
        type=float,
        default=10.0,
        help="seconds over which --min-upload-rate is averaged",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="close a connection that has not sent a complete request head this long after it "
        "opened or its last reply, s",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections served at once (default: the open-file limit, ulimit -n, less 256)",
    )
    p.add_argument(
        "--max-connections-per-ip",
        type=int,
        default=64,
        help="connections from one address that have not shown the token; a new one closes "
        "the oldest",
    )
    p.add_argument(
        "--upload-slots",
        type=int,
        default=1,
        help="uploads received at once, each into a buffer of up to the model's fp32 size (half "
        "with bf16 uploads); raise it when workers reach the server over links slower than its "
        "own (default 1: memory flat in the number of workers, uploads queue)",
    )
    g = p.add_argument_group("async mode (arXiv 2401.09135)")
    g.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="apply each submission when it arrives, with no barrier",
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="refuse (409, rebase) submissions more than this many updates old",
    )
    g.add_argument(
        "--staleness-weighting",
        choices=("none", "inverse_sqrt"),
        default="none",
        help="scale a pseudo-gradient by 1/sqrt(1 + staleness)",
    )
    g.add_argument(
        "--delayed-nesterov",
        action="store_true",
        help="Delayed Nesterov outer optimizer: g/N per arrival, momentum once per N arrivals",
    )
    g.add_argument(
        "--dn-buffer-size", type=int, default=None, help="Delayed Nesterov's N (default: -n)"
    )
    g.add_argument(
        "--dn-activation", type=float, default=0.0, help="Delayed Nesterov's c in [0, 1/N]"
    )
    g = p.add_argument_group("dynamic local updates and streaming fragments")
    g.add_argument(
        "--dylu",
        action="store_true",
        help="recommend sync_every per worker from its speed (workers opt in with --dylu)",
    )
    g.add_argument(
        "--dylu-min-sync-every", type=int, default=1, help="smallest sync_every DyLU recommends"
    )
    g.add_argument(
        "--num-fragments",
        type=int,
        default=None,
        help="streaming DiLoCo fragments (default: as the first worker asks)",
    )
    g.add_argument(
        "--fragment-pattern",
        choices=("sequential", "strided"),
        default=None,
        help="how fragments cut the model (default: as the first worker asks)",
    )
    p.set_defaults(func=_server)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server(args: argparse.Namespace) -> int:
    from diloco.server import DiLoCoServer, ServerConfig

    token = args.token
    if not token and not is_loopback(args.host):
        # Beyond loopback the API is never left open by accident.
        token = secrets.token_urlsafe(24)
        print(
            f"diloco: no --token given and the server binds {args.host}; generated one:\n"
            f"  DILOCO_TOKEN={token}\n"
            "give it to the workers (DILOCO_TOKEN) and to the dashboard",
            file=sys.stderr,
            flush=True,
        )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        num_workers=args.num_workers,
        min_workers=args.min_workers,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        nesterov=not args.no_nesterov,
        initial_params=args.initial_params,
        save_dir=args.save_dir,
        save_every=args.save_every,
        keep_checkpoints=args.keep,
        from_checkpoint=args.from_checkpoint,
        fresh_start=args.fresh_start,
        token=token or None,
        admin_token=args.admin_token or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_failure_limit=args.auth_failure_limit,
        weighting=args.weighting,
        clip_norm_factor=args.clip_norm_factor,
        trim_fraction=args.trim_fraction,
        poll_timeout=args.poll_timeout,
        body_timeout=args.body_timeout,
        min_upload_rate=args.min_upload_rate,
        upload_rate_window=args.upload_rate_window,
        header_timeout=args.header_timeout,
        max_connections=args.max_connections,
        max_connections_per_ip=args.max_connections_per_ip,
        upload_slots=args.upload_slots,
        heartbeat_timeout=args.heartbeat_timeout,
        stuck_timeout=args.stuck_timeout,
        join_timeout=args.join_timeout,
        mode="async" if args.async_mode else "sync",
        max_staleness=args.max_staleness,
        staleness_weighting=args.staleness_weighting,
        delayed_nesterov=args.delayed_nesterov,
        dn_buffer_size=args.dn_buffer_size,
        dn_activation=args.dn_activation,
        dylu=args.dylu,
        dylu_min_sync_every=args.dylu_min_sync_every,
        num_fragments=args.num_fragments,
        fragment_pattern=args.fragment_pattern,
    )
    server = DiLoCoServer(config)
    server.run()
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a server's state")
    p.add_argument(
        "--server", default=os.environ.get("DILOCO_SERVER", "127.0.0.1:8512"), help="host:port"
    )
    p.add_argument("--token", default=os.environ.get("DILOCO_TOKEN"))
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("DILOCO_TLS_CA"),
        help="PEM file of the CA that signed an https:// server's certificate",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=_status)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _num(value: Any, fmt: str, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:{fmt}}{unit}"


def render_status(st: dict[str, Any]) -> str:
    """The state of a server at a glance (the same figures as ``/metrics``). Keys are read
    with ``.get``: an older or newer server may lack some."""
    opt = st.get("outer_optimizer") or {}
    stale = st.get("staleness") or {}
    workers = st.get("workers") or []
    submitted = set(st.get("submitted") or [])
    state = "open" if st.get("opened", True) else "waiting for workers"
    lines = [
        f"mode {st.get('mode', 'sync')}  round {st.get('round', '-')}  {state}"
        f"  uptime {_num(st.get('uptime_s'), '.0f', 's')}",
        f"workers {len(workers)} live, expected {st.get('num_workers', '-')}, "
        f"min {st.get('min_workers', '-')}  deaths {st.get('worker_deaths', 0)}"
        f"  registrations {st.get('registrations', 0)}",
        f"model {_num(st.get('num_params'), ',')} params ({_fmt_bytes(st.get('model_bytes') or 0)})"
        f"  outer lr {opt.get('lr', '-')} momentum {opt.get('momentum', '-')}",
        f"round: expected {len(st.get('expected') or [])}, submitted {len(submitted)}"
        f"  last round {_num(st.get('last_round_time_s'), '.3f', ' s')}"
        f"  contributions {st.get('last_round_contributions', '-')}",
        f"bytes in {_fmt_bytes(st.get('bytes_in') or 0)}  out {_fmt_bytes(st.get('bytes_out') or 0)}"
        f"  rejected submissions {st.get('rejected_submissions', 0)}",
        f"uploads: {st.get('upload_slots', '-')} slot(s), {st.get('uploads_waiting', 0)} waiting"
        f"  last round's longest wait {_num(st.get('last_round_upload_wait_max_s'), '.3f', ' s')}",
    ]
    if st.get("mode") == "async" or stale.get("count"):
        lines.append(
            f"staleness last {stale.get('last', '-')}  mean {_num(stale.get('mean'), '.2f')}"
            f"  max {stale.get('max', '-')}  ({stale.get('count', 0)} submissions;"
            f" max allowed {st.get('max_staleness') or '-'})"
        )
    if st.get("fragments"):
        rounds = " ".join(str(f.get("round")) for f in st["fragments"])
        lines.append(f"fragments ({st.get('fragment_pattern')}): rounds {rounds}")
    if st.get("last_save_error"):
        lines.append(f"last save FAILED: {st['last_save_error']}")
    lines += [
        "",
        f"{'worker':<20} {'host':<16} {'round':>5} {'steps/s':>8} {'loss':>8} {'seen':>7}"
        f" {'sent':>10} {'recv':>10}",
    ]
    for w in workers:
        wid = str(w.get("worker_id", "?"))
        mark = "*" if wid in submitted else " "
        last = w.get("last_round")
        lines.append(
            f"{wid[:19] + mark:<20} {str(w.get('hostname', ''))[:16]:<16}"
            f" {('-' if last is None else str(last)):>5} {_num(w.get('steps_per_second'), '.2f'):>8}"
            f" {_num(w.get('loss'), '.4f'):>8} {_num(w.get('last_seen_s_ago'), '.1f', 's'):>7}"
            f" {_fmt_bytes(w.get('bytes_in') or 0):>10} {_fmt_bytes(w.get('bytes_out') or 0):>10}"
        )
    if not workers:
        lines.append("(no workers)")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from diloco.worker import DiLoCoClient, ServerError, Unreachable

    client = DiLoCoClient(
        args.server, token=args.token, tls_ca=args.tls_ca, retries=0, read_timeout=10
    )
    try:
        st = client.status()
    except Unreachable as exc:
        print(f"error: cannot reach {args.server}: {exc.__cause__ or exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else render_status(st))
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run a training command as a DiLoCo worker",
        description="Runs COMMAND with DILOCO_* variables set; DiLoCoWorker reads them as defaults.",
    )
    p.add_argument("--server", default=None, help="host:port of the server")
    p.add_argument("--sync-every", type=int, default=None, help="inner steps between syncs")
    p.add_argument("--no-bf16", action="store_true", help="send fp32 pseudo-gradients")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--heartbeat-interval", type=float, default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--tls-ca", default=None, help="PEM file of the server certificate's CA")
    p.add_argument(
        "--dylu",
        action="store_true",
        default=None,
        help="follow the server's recommended sync_every (DyLU)",
    )
    p.add_argument(
        "--num-fragments", type=int, default=None, help="streaming DiLoCo: fragments (P)"
    )
    p.add_argument("--fragment-pattern", choices=("sequential", "strided"), default=None)
    p.add_argument(
        "--overlap-steps", type=int, default=None, help="streaming: overlap tau, inner steps"
    )
    p.add_argument(
        "--merge-alpha", type=float, default=None, help="streaming: local share alpha in merges"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=_worker)


def _worker(args: argparse.Namespace) -> int:
    from diloco.worker.settings import resolve, to_env

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(
            "error: give the training command after --, e.g. diloco worker -- python train.py",
            file=sys.stderr,
        )
        return 2
    settings = resolve(
        {
            "server_addr": args.server,
            "sync_every": args.sync_every,
            "bf16_comm": False if args.no_bf16 else None,
            "worker_id": args.worker_id,
            "heartbeat_interval": args.heartbeat_interval,
            "token": args.token,
            "tls_ca": args.tls_ca,
            "dylu": args.dylu,
            "num_fragments": args.num_fragments,
            "fragment_pattern": args.fragment_pattern,
            "overlap_steps": args.overlap_steps,
            "merge_alpha": args.merge_alpha,
        }
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DILOCO_") or k == "DILOCO_LOG_LEVEL"
    }
    env.update(to_env(settings))
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        print(f"error: command not found: {command[0]}", file=sys.stderr)
        return 127


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from diloco.demo import run as demo  # light: heavy imports happen inside demo.run

    p = sub.add_parser("demo", help="train a small character model with a local server and workers")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description="DiLoCo training over ordinary networks"
    )
    parser.add_argument("--log-level", default=os.environ.get("DILOCO_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_server(sub)
    _add_status(sub)
    _add_worker(sub)
    try:
        _add_demo(sub)
    except ImportError as exc:  # the demo is optional for the server and worker commands
        log.debug("demo unavailable: %s", exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except ValueError as exc:  # bad configuration: say it plainly, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
