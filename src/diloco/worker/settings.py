"""Worker settings, and the ``DILOCO_*`` environment variables ``diloco worker`` sets for them."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.core.codecs import FOUR_BIT, Codec, CodecError, LowRankCodec, codec_from_metadata
from diloco.core.codecs.by_name import PREFIX
from diloco.core.fragments import PATTERNS, SEQUENTIAL
from diloco.wire.messages import ErrorBody
from diloco.worker.transport.address import DEFAULT_PORT


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """A field with a ``diloco worker`` flag: ``help`` and the keys that ``diloco.cli.flags``
    documents go in its metadata, so the flag is declared here, beside the setting."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class WorkerSettings:
    enabled: bool = True
    """False: DiLoCo is off. The worker does nothing at all (no optimizer hook, no connection,
    no thread; ``start``, ``stop`` and ``force_sync`` return at once, ``sync_metrics`` reads
    zeros) and says so in one log line, so one script trains alone (``DILOCO_ENABLED=0``) or
    in a run. No ``diloco worker`` flag: a command run without ``diloco worker`` is the off
    switch there."""

    server_addr: str = _flag(
        f"127.0.0.1:{DEFAULT_PORT}",
        "host[:port] of the server (port 8512 if none)",
        flag="--server",
    )
    """``host:port`` (or a full http:// or https:// URL) of the server; a host without a port
    (``localhost``) means the default port, 8512."""

    sync_every: int = _flag(500, "inner steps between syncs")
    """Inner optimizer steps between syncs (H in the paper)."""

    bf16_comm: bool = _flag(True, "send fp32 pseudo-gradients", flag="--no-bf16")
    """Send pseudo-gradients as bfloat16 (half the bytes; the sum stays fp32 on the server).
    Read only when ``codec`` is None: an explicit codec wins."""

    codec: str | None = _flag(
        None,
        "pseudo-gradient codec: fp32, bf16, int8, int4, lowrank or lowrank:RANK, "
        "options as NAME:KEY=VALUE,... (default: bf16, fp32 with --no-bf16)",
        metavar="CODEC",
    )
    """How pseudo-gradients travel (``parse_codec``): ``fp32``, ``bf16`` (lossless or today's
    rounding, sent as computed), ``int8``, ``int4`` (blockwise, with error feedback), ``lowrank``
    (PowerSGD factors of rank 4, with error feedback; ``lowrank:8`` for rank 8); ``error_feedback``
    turns the feedback off. Options go after a colon: ``int8:block=128``,
    ``lowrank:rank=8,fallback=int4``. None: ``bf16``, or ``fp32`` when ``bf16_comm`` is False. The
    server must allow it (``diloco server --codecs``)."""

    error_feedback: bool = _flag(True, "lossy codec: each round on its own, no error feedback")
    """With a lossy codec (``int8``, ``int4``, ``lowrank``), what the codec drops is added to the
    next round's pseudo-gradient, so it is delayed, not lost. False sends each round's
    pseudo-gradient encoded on its own (to measure what error feedback buys); in all-reduce mode
    the quantized collective (``int8``, ``int4``, ``topk``) then keeps no residual either. Raw
    codecs (``fp32``, ``bf16``) keep no residual either way."""

    ef_decay: float | None = _flag(
        None, "lossy codec: error feedback's decay in [0, 1] (default: the server's rule's)"
    )
    """With error feedback, the residual is scaled by this before it is added to the next
    pseudo-gradient (``ErrorFeedback``'s ``decay``). None: the server's outer rule decides at
    registration (``core/outer_rules.py``): 1 (plain feedback, today's bits) under ``sgd``, the
    SparseLoCo paper's 0.95 under ``sparseloco``."""

    save_dir: str | None = _flag(
        None, "all-reduce mode: where this worker writes the run's checkpoints as rank 0"
    )
    """All-reduce mode only: the folder where this worker, when it is rank 0 of a quorum that the
    server asks to save (``--save-every``, ``/control/save_state``), writes the run's state in the
    server mode's checkpoint layout (``diloco.persistence``), so ``diloco server --save-dir`` can
    resume from it. None: this worker never writes one."""

    worker_id: str | None = _flag(None, "stable id (default: the server makes one up)")
    """Stable id; the server makes one up when None."""

    token: str | None = _flag(None, "bearer token the server requires")
    """Bearer token the server requires, if any."""

    tls_ca: str | None = _flag(None, "PEM file of the server certificate's CA")
    """PEM file of the certificate authority (or the self-signed certificate) that signed an
    ``https://`` server's certificate; None trusts the system's authorities. Certificates are
    always verified."""

    heartbeat_interval: float = _flag(30.0, "seconds between heartbeats (0: none)")
    """Seconds between heartbeats (0 disables them)."""

    connect_timeout: float = 10.0
    """TCP connect timeout of every request, seconds."""

    read_timeout: float = 120.0
    """Read timeout of every request; must exceed the server's poll_timeout."""

    retries: int = 5
    """Retries of a failed request (exponential backoff with jitter) before giving up on a sync;
    training then goes on locally and the next sync tries again."""

    max_barrier_wait: float = 3600.0
    """Longest a worker waits for a round to close before it rebases and trains on."""

    num_fragments: int = _flag(1, "streaming DiLoCo: fragments (P)")
    """Streaming DiLoCo: sync the model in this many fragments, one every
    ``sync_every / num_fragments`` steps, each once per ``sync_every`` steps (1: plain DiLoCo)."""

    fragment_pattern: str = _flag(
        SEQUENTIAL, "streaming: how fragments cut the model", choices=PATTERNS
    )
    """How fragments are cut: ``sequential`` (contiguous runs of layers) or ``strided``
    (interleaved across the depth of the network)."""

    overlap_steps: int = _flag(0, "streaming: overlap tau, inner steps")
    """Streaming: inner steps a fragment's exchange may overlap with training (tau) before its
    result is merged; 0 waits for it at once."""

    merge_alpha: float = _flag(0.5, "streaming: local share alpha in merges")
    """Streaming: a returned fragment becomes ``alpha * local + (1 - alpha) * global``."""

    dylu: bool = _flag(False, "follow the server's recommended sync_every (DyLU)")
    """Dynamic local updates: adopt the ``sync_every`` the server recommends for this worker's
    speed (the server must run with DyLU on)."""

    log_level: str = "INFO"
    """Level of the ``diloco`` logger when the worker installs its own handler: only when the
    program configured no logging (neither the root logger nor ``diloco`` has a handler), so
    joins, rounds, rebases and failures show on stderr with no setup, and never twice.
    ``diloco worker`` sets it from its ``--log-level`` (``diloco --log-level DEBUG worker``)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        for name in ("heartbeat_interval", "connect_timeout", "read_timeout", "max_barrier_wait"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite non-negative number, got {value}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not 1 <= self.num_fragments <= self.sync_every:
            raise ValueError(
                f"num_fragments must be in [1, sync_every={self.sync_every}], "
                f"got {self.num_fragments}"
            )
        if self.fragment_pattern not in PATTERNS:
            raise ValueError(
                f"fragment_pattern must be 'sequential' or 'strided', got {self.fragment_pattern!r}"
            )
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if not (math.isfinite(self.merge_alpha) and 0 <= self.merge_alpha <= 1):
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if self.ef_decay is not None and not (
            math.isfinite(self.ef_decay) and 0 <= self.ef_decay <= 1
        ):
            raise ValueError(f"ef_decay must be in [0, 1], got {self.ef_decay}")
        if self.codec is not None:
            codec = parse_codec(self.codec)
            if self.num_fragments > 1 and isinstance(codec, LowRankCodec):
                raise ValueError(
                    "codec lowrank needs whole matrices, and streaming DiLoCo sends fragments as "
                    "flat pieces: use int8 or int4 with num_fragments > 1"
                )
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(
                f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {self.log_level!r}"
            )


#: The option a bare value after the colon sets (``lowrank:8`` is ``lowrank:rank=8``).
MAIN_OPTION = {"lowrank": "rank", "int8": "block", FOUR_BIT: "block", "topk": "density"}


def parse_codec(spec: str) -> Codec:
    """The codec ``spec`` names: ``NAME``, ``NAME:VALUE`` (the main option: a rank, a block) or
    ``NAME:KEY=VALUE,KEY=VALUE`` (``lowrank:rank=8,fallback=int4``). A ``ValueError`` naming the
    known codecs for an unknown name, or saying which option is wrong."""
    name, _, rest = spec.strip().partition(":")
    meta = {"codec": name.strip()}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            if meta["codec"] not in MAIN_OPTION:
                raise ValueError(f"codec {spec!r}: {meta['codec']} takes options as KEY=VALUE")
            key, value = MAIN_OPTION[meta["codec"]], item
        meta[PREFIX + key.strip()] = value.strip()
    try:
        return codec_from_metadata(meta, from_peer=False)  # defaults fill what a user leaves out
    except CodecError as exc:
        raise ValueError(f"codec {spec!r}: {exc.detail}") from None


def chosen_codec(settings: WorkerSettings) -> Codec:
    """``settings.codec``, or the codec ``bf16_comm`` has always meant."""
    if settings.codec is not None:
        return parse_codec(settings.codec)
    return parse_codec("bf16" if settings.bf16_comm else "fp32")


#: What a server answers at registration about a codec it will not take.
CODEC_REFUSALS = frozenset({"unknown_codec", "bad_option", "codec_refused"})


def refused_codec(reply: ErrorBody, codec: Codec) -> ValueError | None:
    """The error to raise at start when the server's error ``reply`` refused the worker's
    codec; None for any other error."""
    if reply.error not in CODEC_REFUSALS:
        return None
    hint = f" (it takes {', '.join(reply.allowed)})" if reply.allowed is not None else ""
    return ValueError(
        f"the server refuses codec {codec!r}: {reply.detail}{hint}; choose another with "
        "codec=... (DILOCO_CODEC, diloco worker --codec)"
    )


ENV_PREFIX = "DILOCO_"
#: ``DILOCO_*`` variables the server reads that are none of the worker's (the server's
#: ``_flag(env=...)``; a unit test holds the two lists together). A shell that starts the server
#: exports them, and a worker started from it must not refuse to run.
SERVER_ONLY = frozenset({"DILOCO_ADMIN_TOKEN", "DILOCO_UPSTREAM_TOKEN"})
_ENV_FIELDS = {f"{ENV_PREFIX}{f.name.upper()}": f for f in dataclasses.fields(WorkerSettings)}
_ENV_FIELDS[f"{ENV_PREFIX}SERVER"] = _ENV_FIELDS.pop(f"{ENV_PREFIX}SERVER_ADDR")


def _parse(name: str, kind: Any, raw: str) -> Any:
    if kind in (bool, "bool"):
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
    if kind in (int, "int"):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    if kind in (float, "float"):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
    return raw or None


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings named by ``DILOCO_*`` variables. An unknown ``DILOCO_*`` name is an error, so a
    typo does not silently fall back to a default; the server's own (``SERVER_ONLY``) are
    ignored."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in SERVER_ONLY:
            continue
        field = _ENV_FIELDS.get(name)
        if field is None:
            known = ", ".join(sorted(_ENV_FIELDS))
            raise ValueError(f"unknown environment variable {name}; known: {known}")
        kind = field.type.replace(" | None", "") if isinstance(field.type, str) else field.type
        out[field.name] = _parse(name, kind, raw)
    return out


def resolve(
    explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> WorkerSettings:
    """Explicit arguments win over ``DILOCO_*`` variables, which win over defaults."""
    # An empty variable means unset, as everywhere ``DILOCO_*`` is read.
    merged = {k: v for k, v in env_overrides(environ).items() if v is not None}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    return WorkerSettings(**merged)


def off_reason(explicit: bool | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Why DiLoCo is off (``"enabled=False"``, ``"DILOCO_ENABLED=0"``); None when it is on. The
    argument wins over the variable, as for every setting."""
    if explicit is not None:
        return None if explicit else "enabled=False"
    environ = os.environ if environ is None else environ
    name = f"{ENV_PREFIX}ENABLED"
    if env_overrides(environ).get("enabled") is False:
        return f"{name}={environ[name]}"
    return None


def to_env(settings: WorkerSettings) -> dict[str, str]:
    """The variables that make ``resolve({})`` in a child process give back ``settings``."""
    out: dict[str, str] = {}
    for name, field in _ENV_FIELDS.items():
        value = getattr(settings, field.name)
        if value is None:
            continue
        out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out
