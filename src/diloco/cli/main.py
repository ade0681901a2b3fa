"""The ``diloco`` command: one module per subcommand; this one only dispatches."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from diloco.cli import export, server, status, swarm_peer, worker

log = logging.getLogger("diloco.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description="DiLoCo training over ordinary networks"
    )
    parser.add_argument("--log-level", default=os.environ.get("DILOCO_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    server.add_parser(sub)
    status.add_parser(sub)
    worker.add_parser(sub)
    export.add_parser(sub)
    swarm_peer.add_parser(sub)
    try:
        from diloco.cli import demo

        demo.add_parser(sub)
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
