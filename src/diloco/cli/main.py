"""The ``diloco`` command: thin argument parsing over the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
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
        "--weighting",
        choices=("equal", "samples"),
        default="equal",
        help="average contributions equally or by the samples each worker reports",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("DILOCO_TOKEN"),
        help="shared token (default: $DILOCO_TOKEN)",
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
        "--poll-timeout",
        type=float,
        default=30.0,
        help="longest a parameter long-poll waits, seconds",
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


def _server(args: argparse.Namespace) -> int:
    from diloco.server import DiLoCoServer, ServerConfig

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
        token=args.token,
        weighting=args.weighting,
        poll_timeout=args.poll_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        stuck_timeout=args.stuck_timeout,
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
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=_status)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def render_status(st: dict[str, Any]) -> str:
    opt = st.get("outer_optimizer") or {}
    lines = [
        f"mode {st['mode']}  round {st['round']}  {'open' if st['opened'] else 'waiting for workers'}"
        f"  uptime {st['uptime_s']:.0f}s",
        f"workers {len(st['workers'])} registered, round 0 needs {st['num_workers']}, min {st['min_workers']}"
        f"  deaths {st['worker_deaths']}",
        f"model {st['num_params']:,} params ({_fmt_bytes(st['model_bytes'])})"
        f"  outer lr {opt.get('lr', '-')} momentum {opt.get('momentum', '-')}",
        f"round: expected {len(st['expected'])}, submitted {len(st['submitted'])}"
        f"  last round {st['last_round_time_s'] if st['last_round_time_s'] is not None else '-'} s",
        f"bytes in {_fmt_bytes(st['bytes_in'])}  out {_fmt_bytes(st['bytes_out'])}",
    ]
    stale = st.get("staleness") or {}
    if st.get("mode") == "async":
        lines.append(
            f"staleness: last {stale.get('last', '-')}  mean {stale.get('mean', '-')}"
            f"  max {stale.get('max', '-')}  (max allowed {st.get('max_staleness') or '-'})"
        )
    if st.get("fragments"):
        rounds = " ".join(str(f["round"]) for f in st["fragments"])
        lines.append(f"fragments ({st.get('fragment_pattern')}): rounds {rounds}")
    lines += [
        "",
        f"{'worker':<20} {'host':<16} {'round':>5} {'steps/s':>8} {'loss':>8} {'seen':>7} {'sent':>10} {'recv':>10}",
    ]
    for w in st["workers"]:
        sps = f"{w['steps_per_second']:.2f}" if w["steps_per_second"] is not None else "-"
        loss = f"{w['loss']:.4f}" if w["loss"] is not None else "-"
        last = w["last_round"] if w["last_round"] is not None else "-"
        mark = "*" if w["worker_id"] in st["submitted"] else " "
        lines.append(
            f"{w['worker_id'][:19] + mark:<20} {w['hostname'][:16]:<16} {last!s:>5} {sps:>8} {loss:>8}"
            f" {w['last_seen_s_ago']:>6.1f}s {_fmt_bytes(w['bytes_in']):>10} {_fmt_bytes(w['bytes_out']):>10}"
        )
    if not st["workers"]:
        lines.append("(no workers)")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from diloco.worker import DiLoCoClient, ServerError, Unreachable

    client = DiLoCoClient(args.server, token=args.token, retries=0, read_timeout=10)
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
