"""``diloco server``: run a parameter server; its flags are ``ServerConfig``'s fields."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import secrets
import sys

from diloco.cli import flags
from diloco.server.config import ServerConfig

#: ``ServerConfig`` fields with no flag, and why (a test holds every other field to a flag).
NOT_EXPOSED = {
    "auth_failure_window": "tuned with --auth-failure-limit in mind; its minute is in that "
    "flag's help, and changing one without the other is a mistake",
    "max_initial_bytes": "a safety bound on a first upload before the model is known, not a "
    "knob: the Python API can raise it for a model over 64 GiB",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run a DiLoCo parameter server")
    flags.add_flags(p, ServerConfig)
    p.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from diloco.server import DiLoCoServer

    settings = flags.values(ServerConfig, args)
    if not settings["token"] and not is_loopback(settings["host"]):
        # Beyond loopback the API is never left open by accident.
        settings["token"] = secrets.token_urlsafe(24)
        print(
            f"diloco: no --token given and the server binds {settings['host']}; generated one:\n"
            f"  DILOCO_TOKEN={settings['token']}\n"
            "give it to the workers (DILOCO_TOKEN) and to the dashboard",
            file=sys.stderr,
            flush=True,
        )
    server = DiLoCoServer(ServerConfig(**settings))
    try:
        server.run()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        host, port = settings["host"], settings["port"]
        print(
            f"error: port {port} on {host} is in use (another diloco server?); stop it or "
            "choose another port with --port",
            file=sys.stderr,
        )
        return 2
    return 0
