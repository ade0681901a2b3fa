"""``diloco demo``'s flags: ``--swarm`` changes the defaults it documents (2 workers, 200
steps) and refuses what it cannot run beside; without it the defaults are as before."""

from __future__ import annotations

import argparse

from diloco.demo import run as demo


def settled(*argv: str) -> tuple[argparse.Namespace, str | None]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return args, demo.settle(args)


def test_defaults_without_and_with_swarm() -> None:
    args, refused = settled()
    assert refused is None and (args.workers, args.steps, args.swarm) == (4, 1000, False)
    args, refused = settled("--swarm")
    assert refused is None and (args.workers, args.steps, args.sync_every) == (2, 200, 50)
    assert demo.SWARM_STEPS == 200  # the figure the README and --help give
    args, refused = settled("--swarm", "--steps", "20", "--workers", "2")
    assert refused is None and args.steps == 20


def test_swarm_refuses_other_worker_counts_and_allreduce() -> None:
    assert "--swarm" in (settled("--swarm", "--workers", "3")[1] or "")
    assert "--swarm" in (settled("--swarm", "--allreduce")[1] or "")
    assert settled("--steps", "0")[1] is not None
