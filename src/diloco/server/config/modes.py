"""The server settings of its modes beyond sync rounds: async mode and Delayed Nesterov, dynamic
local updates and streaming fragments, all-reduce mode, the pipeline swarm and the regional
relay. Which of them go together is ``checks.py``'s business."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.fragments import PATTERNS
from diloco.core.staleness import POLICY_NAMES
from diloco.server.config.declare import (
    _ALLREDUCE,
    _ASYNC,
    _DYNAMIC,
    _RELAY,
    _SWARM,
    RELAY_CODECS,
    _flag,
)
from diloco.server.config.traffic import TrafficSettings


@dataclass(frozen=True)
class ModeSettings(TrafficSettings):
    """The last fields of ``ServerConfig``, in ``--help`` order: with its bases, every setting."""

    mode: str = _flag(
        "sync",
        "apply each submission when it arrives, with no barrier",
        flag="--async",
        switch="async",
        group=_ASYNC,
    )
    """``sync``: rounds behind a barrier. ``async``: each submission is applied as it arrives."""

    max_staleness: int | None = _flag(
        None,
        "refuse (409, rebase) submissions more than this many updates old",
        group=_ASYNC,
    )
    """Async: refuse (409, rebase) a submission computed against parameters more than this many
    updates old. None accepts any."""

    staleness_weighting: str = _flag(
        "none",
        "scale a pseudo-gradient by its staleness s: none (1), inverse_sqrt (1/sqrt(1 + s)), "
        "age_gate (a cosine falling to 0 past --staleness-cutoff)",
        choices=POLICY_NAMES,
        group=_ASYNC,
    )
    """Async: the staleness policy (``core/staleness.py``): ``none``, ``inverse_sqrt`` (scale a
    pseudo-gradient by 1/sqrt(1 + staleness)), or ``age_gate`` (``(1 + cos(pi s / (S + 1))) / 2``
    up to ``staleness_cutoff`` S, and 0 past it: such an upload is acknowledged, not applied)."""

    staleness_cutoff: int | None = _flag(
        None,
        "age_gate: apply uploads at most S updates old; older ones are acknowledged, not applied",
        metavar="S",
        group=_ASYNC,
    )
    """Async, ``age_gate`` (required there, refused elsewhere): the staleness past which an
    upload's weight is 0. The server acknowledges such an upload (a retry is a duplicate) and
    changes nothing; its worker adopts the current parameters and counts those steps dropped."""

    delayed_nesterov: bool = _flag(
        False,
        "Delayed Nesterov outer optimizer: g/N per arrival, momentum once per N arrivals",
        group=_ASYNC,
    )
    """Async: use Delayed Nesterov (Liu et al. 2024, Algorithm 3) as the outer optimizer: every
    arrival applies g/N, momentum moves once per N arrivals."""

    dn_buffer_size: int | None = _flag(
        None,
        "Delayed Nesterov's N (default: -n); given, it turns Delayed Nesterov on, 0 off",
        group=_ASYNC,
    )
    """Delayed Nesterov's N (arrivals per momentum step); None: ``num_workers``. As in the
    reference, a value above 0 turns Delayed Nesterov on (``delayed_nesterov``), 0 turns it
    off."""

    dn_activation: float = _flag(0.0, "Delayed Nesterov's c in [0, 1/N]", group=_ASYNC)
    """Delayed Nesterov's c in [0, 1/N]: share of the momentum applied at every arrival."""

    dylu: bool = _flag(
        False,
        "recommend sync_every per worker from its speed (workers opt in with --dylu)",
        group=_DYNAMIC,
    )
    """Dynamic local updates: recommend ``sync_every`` per worker from its smoothed speed,
    H_w = max(floor(v_w / v_max * H_w_base), dylu_min_sync_every), in heartbeat replies."""

    dylu_min_sync_every: int = _flag(
        1,
        "smallest sync_every DyLU recommends",
        group=_DYNAMIC,
    )
    """Smallest ``sync_every`` DyLU recommends."""

    dylu_base_sync_every: int | None = _flag(
        None,
        "DyLU's H_base, the fastest worker's sync_every (default: each worker's own)",
        group=_DYNAMIC,
    )
    """DyLU's ``H_base``: the ``sync_every`` recommended to the fastest worker. None: each
    worker's own ``sync_every`` (from its registration), so workers started with different
    values keep their ratio. The reference sets it on the server (its default 500); here the
    workers' own value is the default because it is what each script was tuned with."""

    num_fragments: int | None = _flag(
        None,
        "streaming DiLoCo fragments (default: as the first worker asks)",
        group=_DYNAMIC,
    )
    """Streaming DiLoCo: synchronise the model in this many fragments, each with its own rounds
    and outer optimizer state. None: as the first worker to register asks (1 for plain workers)."""

    fragment_pattern: str | None = _flag(
        None,
        "how fragments cut the model (default: as the first worker asks)",
        choices=PATTERNS,
        group=_DYNAMIC,
    )
    """``sequential`` or ``strided`` (None: as the first worker asks)."""

    allreduce: bool = _flag(
        False,
        "workers average among themselves (torch.distributed); the server holds no "
        "parameters and only forms a quorum per round",
        group=_ALLREDUCE,
    )
    """All-reduce mode: the workers average their pseudo-gradients with collectives and each
    applies the outer step; the server keeps membership, forms one quorum per round (ranks and a
    rendezvous it hosts) and records outcomes (``server/allreduce/quorum_book.py``). It holds no
    parameters, so it refuses ``initial_params``, checkpoints of its own, async mode, fragments,
    robust aggregation and a lossy ``download_codec``."""

    collective_timeout: float = _flag(
        30.0, "bound on each collective of a quorum, s", group=_ALLREDUCE
    )
    """All-reduce mode: seconds a quorum's members wait for one another in each collective
    (sent to them); a quorum with no outcome after 3 x this plus ``poll_timeout`` is discarded."""

    swarm: bool = _flag(
        False,
        "coordinate a pipeline swarm: peers each host one stage of the model; the server "
        "assigns stages and serves the route table, and holds no parameters",
        group=_SWARM,
    )
    """Swarm mode (``server/swarm/``): each registering peer is assigned one of ``stages``
    pipeline stages, says when its stage service is ready (``POST /swarm/ready``, its stage's
    parameter table checked) and drivers read the live replicas from ``GET /swarm/routes``. It
    holds no parameters, so it refuses what all-reduce mode refuses, and ``--allreduce``."""

    stages: int = _flag(3, "pipeline stages the model is split into (--swarm)", group=_SWARM)
    """Swarm mode: the pipeline's stages (at least 2: one stage is a plain worker's model)."""

    min_replicas: int = _flag(
        2,
        "replicas every stage gets before any stage gets more (--swarm)",
        group=_SWARM,
    )
    """Swarm mode: joining peers fill every stage to this many replicas (fewest first), then
    go to the stage whose replicas report the least throughput."""

    upstream: str | None = _flag(
        None,
        "run as a regional relay: this server is one worker of the server at HOST:PORT; each "
        "round it sends its region's mean pseudo-gradient there and publishes the parameters "
        "it gets back",
        metavar="HOST:PORT",
        group=_RELAY,
    )
    """A regional relay (``server/relay/``): its workers see an ordinary sync server, but a
    closed round's weighted mean pseudo-gradient is uploaded to the upstream server (one upload
    per round, weighted by the round's total weight: its contribution count under ``equal``
    weighting) instead of stepping an outer optimizer here, and the upstream's next parameters
    are published as the next round. A fresh relay takes its parameters from the upstream (or
    seeds it with its first worker's). Sync mode, whole-model rounds only."""

    upstream_token: str | None = _flag(
        None, "bearer token of the upstream server", env="DILOCO_UPSTREAM_TOKEN", group=_RELAY
    )
    """The upstream server's token (a worker's ``token``), if it requires one."""

    upstream_tls_ca: str | None = _flag(
        None, "PEM file of the upstream server certificate's CA", group=_RELAY
    )
    """A worker's ``tls_ca`` for the upstream: its certificate's CA (None: the system's)."""

    upstream_codec: str = _flag(
        "bf16", "how the region's mean travels upstream", choices=RELAY_CODECS, group=_RELAY
    )
    """The codec of the upstream uploads, a worker's default (``bf16``) unless told ``fp32``;
    the upstream must allow it (its ``--codecs``)."""
