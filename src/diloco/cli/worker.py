"""``diloco worker -- COMMAND``: run a training command with the ``DILOCO_*`` variables set.

Its flags are ``WorkerSettings``' fields. They default to unset: a flag given wins over a
``DILOCO_*`` variable, which wins over the dataclass default (``settings.resolve``), the same
order ``DiLoCoWorker`` follows in the command.

Signals: SIGTERM to this process (a scheduler's, ``kill``) is passed on to the command, which
leaves its run cleanly (``diloco.worker.termination``), and this process waits for it. Ctrl-C
reaches the command from the terminal itself; this process ignores it meanwhile, so the command
is never killed halfway through leaving (``subprocess.call`` kills it after 0.25 s). The exit
status is the command's; killed by signal N, 128 + N as shells report it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from diloco.cli import flags
from diloco.worker.settings import WorkerSettings, resolve, to_env

#: ``WorkerSettings`` fields with no flag, and why (a test holds every other field to a flag).
NOT_EXPOSED = {
    name: "rarely tuned: a DILOCO_* variable (or the Python API) sets it, and reaches the command"
    for name in ("connect_timeout", "read_timeout", "retries", "max_barrier_wait")
}
NOT_EXPOSED["enabled"] = (
    "running the command without `diloco worker` is its off switch; DILOCO_ENABLED=0 reaches "
    "it through diloco worker too"
)
NOT_EXPOSED["log_level"] = (
    "the command's own --log-level sets it (diloco --log-level DEBUG worker -- ...): one flag "
    "for the command's log and the child's"
)


#: Options of the reference's worker command that belong to its own trainer (project,
#: template, devices): ``diloco worker`` wraps any command instead.
FORGATHER_OPTIONS = (("-p", "--project"), ("-t", "--template"), ("-d", "--devices"))

EXAMPLE = "diloco worker --sync-every 500 -- python train.py"


def forgather_hint(args: argparse.Namespace) -> str | None:
    """What to write instead of the reference's ``-p PROJECT -t TEMPLATE train -d N`` form, or
    None when the command line has none of it."""
    given = [
        names[0]
        for names in FORGATHER_OPTIONS
        if getattr(args, f"forgather_{names[-1].lstrip('-')}", None) is not None
    ]
    if not given:
        return None
    hint = (
        f"{'/'.join(given)}: Forgather's project options are not diloco's: diloco worker runs "
        f"any training command given after --, e.g. `{EXAMPLE}`"
    )
    devices = getattr(args, "forgather_devices", None)
    rest = list(args.command)
    if devices is None and "-d" in rest[:-1]:  # `train ... -d 0`: the trainer's own option
        devices = rest[rest.index("-d") + 1]
    if devices is not None:
        hint += f"; for -d {devices} put CUDA_VISIBLE_DEVICES={devices} in front of the command"
    return hint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run a training command as a DiLoCo worker",
        description="Runs COMMAND with DILOCO_* variables set; DiLoCoWorker reads them as defaults.",
    )
    flags.add_flags(p, WorkerSettings, unset=True)
    # The reference's worker takes Forgather's project options and runs its `train`: accepted
    # here only to say what to write instead (argparse would stop at "unrecognized -p").
    for names in FORGATHER_OPTIONS:
        p.add_argument(*names, dest=f"forgather_{names[-1].lstrip('-')}", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hint = forgather_hint(args)
    if hint is not None:
        print(f"error: {hint}", file=sys.stderr)
        return 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(f"error: give the training command after --, e.g. {EXAMPLE}", file=sys.stderr)
        return 2
    # The child logs at the command's level (INFO unless --log-level or DILOCO_LOG_LEVEL says
    # otherwise): DiLoCoWorker shows its joins, rounds and failures when the script sets up no
    # logging of its own.
    explicit = {**flags.values(WorkerSettings, args), "log_level": getattr(args, "log_level", None)}
    settings = resolve(explicit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(to_env(settings))
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        print(
            f"error: command not found: {command[0]} (diloco worker runs the command after -- "
            f"as a program, e.g. `{EXAMPLE}`)",
            file=sys.stderr,
        )
        return 127
    return _wait_passing_signals(child)


def _wait_passing_signals(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child``, passing SIGTERM on and ignoring SIGINT meanwhile (set after the
    child started, so it keeps its own defaults); the previous handlers come back after."""

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    if threading.current_thread() is not threading.main_thread():  # no handlers there
        code = child.wait()
        return 128 - code if code < 0 else code
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)
    return 128 - code if code < 0 else code
