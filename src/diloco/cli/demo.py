"""``diloco demo``: its flags and run live in ``diloco.demo.run``; this registers them."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from diloco.demo import run as demo  # light: heavy imports happen inside demo.run

    p = sub.add_parser("demo", help="train a small character model with a local server and workers")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
