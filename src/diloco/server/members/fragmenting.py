"""Fragmenting (streaming DiLoCo): how many fragments the run syncs in and how they cut the model.
Every worker of a run must cut it the same way, in either mode: the first registration sets it
(unless the server's settings or a checkpoint did), a registration that differs is refused
before it changes anything (409 ``fragments_mismatch``, with what to restart the worker with).
"""

from __future__ import annotations

from diloco.core.fragments import SEQUENTIAL
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, conflict

Fragmenting = tuple[int, str]
"""(number of fragments, pattern)."""


def configured_fragmenting(config: ServerConfig) -> Fragmenting | None:
    """The fragmenting the server's settings fix (None: as the first worker asks)."""
    if config.num_fragments is None:
        return None
    return (config.num_fragments, config.fragment_pattern or SEQUENTIAL)


def asked_fragmenting(
    asked: Fragmenting, config: ServerConfig, have: Fragmenting | None
) -> Fragmenting:
    """The fragmenting a registering worker asks for (``RegisterInfo.fragmenting``); refused if
    it differs from the run's (``have``) or the server publishes compressed updates of the whole
    model."""
    num = asked[0]
    if num > 1 and config.lossy_download:
        codec = config.download_codec
        raise ApiError(
            422,
            "fragments_refused",
            f"this server publishes each round as a compressed update of the whole model "
            f"(--download-codec {codec}), which streaming fragments cannot use; start the "
            "worker with num_fragments=1, or the server with --download-codec fp32",
        )
    if have is not None and (asked[0] != have[0] or (have[0] > 1 and asked[1] != have[1])):
        raise conflict(
            "fragments_mismatch",
            f"this run syncs in {have[0]} fragment(s) ({have[1]}); the worker asks for "
            f"{asked[0]} ({asked[1]}). Start it with num_fragments={have[0]}"
            + (f" and fragment_pattern={have[1]!r}" if have[0] > 1 else ""),
            action="reconfigure",
            fragments=have[0],
            fragment_pattern=have[1],
        )
    return asked
