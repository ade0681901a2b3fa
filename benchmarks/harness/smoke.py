"""``--smoke``: every benchmark's setting of a few seconds that checks its own figures.

A smoke run takes the real path end to end (the same processes, servers, links and tables as a
full run) with a tiny model, one or two rounds and one or two workers, and then checks that what
it measured is sane: rounds happened, checksums agree, bytes moved, losses are finite. It exits
0 only then (``require`` raises ``SmokeFailure`` otherwise). Where a part needs what the machine
lacks (root for network namespaces, torchft), it runs the rest and says what it skipped and why
(``skip``). The slow test lane runs every script with ``--smoke``
(tests/processes/test_benchmark_smoke.py).
"""

from __future__ import annotations

import argparse

HELP = "a few seconds' run through the real path (tiny model, 1-2 rounds) that checks its figures"


class SmokeFailure(AssertionError):
    """A smoke run measured something that cannot be right."""


def add_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true", help=HELP)


def require(ok: object, what: str) -> None:
    """Fail the smoke run unless ``ok``: ``what`` says what should have held."""
    if not ok:
        raise SmokeFailure(f"smoke check failed: {what}")


def skip(part: str, why: str) -> None:
    """Say that a part of the smoke run did not run here, and why."""
    print(f"smoke: skipped {part}: {why}", flush=True)


def passed(script: str) -> None:
    print(f"smoke: {script} ok", flush=True)
