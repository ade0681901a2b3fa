"""The server's settings: ``ServerConfig``, one frozen dataclass whose every field carries its
command-line flag and help (``cli/flags.py`` builds ``diloco server``'s options from them).

Its fields are declared in three bases, in ``--help`` order, each a group of settings:
``service.py`` (listening, rounds, the outer step, model and checkpoints), ``traffic.py``
(access, connections, aggregation, timeouts, codecs), ``modes.py`` (async, dynamic, all-reduce,
swarm, relay). ``declare.py`` holds ``_flag`` and the values settings share with their checks;
``checks.py`` validates a whole config at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.server.config.checks import check
from diloco.server.config.declare import (
    ALLREDUCE_NORM_BOUND,
    DOWNLOAD_CODECS,
    GRACE_CEILING,
    GRACE_FLOOR,
    RELAY_CODECS,
)
from diloco.server.config.modes import ModeSettings

__all__ = [
    "ALLREDUCE_NORM_BOUND",
    "DOWNLOAD_CODECS",
    "GRACE_CEILING",
    "GRACE_FLOOR",
    "RELAY_CODECS",
    "ServerConfig",
]


@dataclass(frozen=True)
class ServerConfig(ModeSettings):
    """Every server setting (the fields of its bases), checked at construction: a bad value
    or a combination a mode refuses raises ValueError and no config exists."""

    def __post_init__(self) -> None:
        check(self)
