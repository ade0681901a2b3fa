"""Server configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.core.codecs import codec_by_name, codec_names
from diloco.core.codecs.downlink import check_download_codec
from diloco.core.codecs.sparse_update import SPARSE_UPDATE
from diloco.core.fragments import PATTERNS
from diloco.core.grace import parse_grace, parse_quorum
from diloco.core.outer_rules import OUTER_RULES, SGD, SPARSELOCO, check_rule, outer_momentum
from diloco.core.staleness import POLICY_NAMES, policy_named


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """A field with a command-line flag: ``help`` and the keys that ``diloco.cli.flags``
    documents go in its metadata, so the flag is declared here, beside the setting."""
    return field(default=default, metadata={"help": help, **cli})


def _carries_updates(name: str) -> bool:
    try:
        check_download_codec(codec_by_name(name))
    except ValueError:
        return False
    return True


#: ``fp32`` (full parameters every round), the codecs that can carry a published update, and
#: ``sparse`` (plain averaged descent's changed positions, ``core/codecs/sparse_update.py``).
DOWNLOAD_CODECS = ("fp32", *(n for n in codec_names() if _carries_updates(n)), SPARSE_UPDATE)

# Sections of ``diloco server --help``.
_ASYNC = "async mode (arXiv 2401.09135)"
_DYNAMIC = "dynamic local updates and streaming fragments"
_ALLREDUCE = "all-reduce mode (issue 19)"
_SWARM = "pipeline swarm (issue 29)"
_RELAY = "regional relay (issue 31)"
#: The codecs a relay may upload with: raw tensors, whose mean the upstream adds as sent (a lossy
#: codec's error feedback would need a residual kept across relay restarts).
RELAY_CODECS = ("fp32", "bf16")
_QUORUM = "sync quorum rounds and late merges (issue 31)"
GRACE_FLOOR = 1.0
GRACE_CEILING = 60.0
ALLREDUCE_NORM_BOUND = 10.0
"""All-reduce mode's ``--clip-norm-factor`` when unset: a member is left out of a round when its
pseudo-gradient norm is above 10 x the quorum's median. Honest members' norms differ by a few
times (data, speed), a diverged member's by orders of magnitude; and unlike the server mode's
clipping, which scales an upload down, leaving out drops a member's whole round, so the default
errs wide."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = _flag("127.0.0.1", "interface to bind")
    """Interface to bind. Loopback by default: binding wider is a deliberate choice."""

    port: int = _flag(8512, "TCP port (0: any free port)")
    """TCP port; 0 picks a free one (read it back from ``DiLoCoServer.address``)."""

    num_workers: int = _flag(1, "workers that must register before round 0 opens", short="-n")
    """Workers that must register before round 0 opens."""

    min_workers: int = _flag(1, "never close a round with fewer contributions")
    """A round never closes with fewer contributions than this."""

    quorum: str | None = _flag(
        None,
        "sync: close a round once K contributions are in (an int, or a fraction in (0, 1] of "
        "its expected workers) and --grace has passed; late uploads are merged",
        group=_QUORUM,
    )
    """Sync quorum rounds (docs/design/server-mode.md, "Quorum rounds"): a round closes once this
    many contributions are in and the grace window has passed since the last of them arrived
    (at once when every expected worker is in). An int, or a fraction of the round's expected
    workers rounded up; never below ``min_workers``. None: the barrier waits for everyone."""

    grace: str | None = _flag(
        None,
        "after the quorum, wait this long for more: seconds, or auto (default): "
        "median + 3 MAD of recent arrivals after the quorum",
        group=_QUORUM,
    )
    """Seconds the round stays open after its quorum, or ``auto`` (the default with
    ``quorum``): from recent arrival offsets after the quorum (``core/grace.py``)."""

    grace_floor: float = _flag(GRACE_FLOOR, "auto grace: shortest window, s", group=_QUORUM)
    """``auto``'s lower bound: a second covers network and scheduling jitter between workers
    that are really equally fast, so closing sooner would turn on-time work into late work."""

    grace_ceiling: float = _flag(GRACE_CEILING, "auto grace: longest window, s", group=_QUORUM)
    """``auto``'s upper bound: a minute bounds what a frozen worker costs a round while leaving
    room for uploads of a large model on a slow link."""

    max_lateness: int = _flag(
        1,
        "merge an upload whose round closed without it into a round at most this many rounds "
        "later, weighted 1/sqrt(1 + lateness); older: 409 stale_round",
        group=_QUORUM,
    )
    """Quorum rounds: an upload whose base round closed without it counts in the open round if
    that is at most this many rounds after its base (weight x 1/sqrt(1 + lateness)); older ones
    are refused (409 ``stale_round``, rebase). 0 refuses them all."""

    outer_lr: float = _flag(0.7, "outer SGD learning rate")
    """Learning rate of the default outer optimizer (SGD with Nesterov momentum)."""

    outer_rule: str = _flag(
        SGD,
        "outer rule: sgd (momentum, Nesterov) or sparseloco (plain averaged descent; the "
        "workers' decayed error feedback stands in for momentum)",
        choices=OUTER_RULES,
    )
    """``sgd``: outer SGD with ``outer_momentum`` and ``nesterov``. ``sparseloco`` (arXiv
    2508.15706): plain averaged descent, no momentum; registering workers are told the rule and
    decay their error feedback (``core/outer_rules.py``). Parameter-server and all-reduce mode
    (the quorums' members step with momentum 0 and decay their quorum residuals); not swarm."""

    outer_momentum: float | None = _flag(None, "outer SGD momentum (default: 0.9; sparseloco: 0)")
    """Momentum of the default outer optimizer. None: the rule's (0.9 under ``sgd``, 0 under
    ``sparseloco``, which refuses any other); a float once constructed."""

    nesterov: bool = _flag(True, "plain momentum instead of Nesterov")
    """Use Nesterov momentum in the default outer optimizer."""

    output_dir: str | None = _flag(
        None,
        "model/output folder: the initial model is read from it when it holds one, checkpoints "
        "go to DIR/checkpoints (resuming from the newest there); --init and --save-dir, given, "
        "take the place of either half",
        short="-o",
        metavar="DIR",
    )
    """A model folder that is also the run's output, as the reference's ``-o``: when it holds
    weights (safetensors, or a PyTorch state dict: ``params/initial.py``) they are the initial
    parameters, else the first worker's are; checkpoints go to ``<output_dir>/checkpoints``
    (``save_dir`` is set to it here, so a restart resumes from there). An explicit
    ``initial_params`` or ``save_dir`` takes the place of its half. Refused in all-reduce mode,
    where the server holds no parameters (the workers' ``save_dir`` is where checkpoints go)."""

    initial_params: str | None = _flag(
        None,
        "initial parameters: a .safetensors or PyTorch state dict (.pt, .pth, .bin) file, or a "
        "model folder (default: the first worker's)",
        flag="--init",
        metavar="PATH",
    )
    """A safetensors file or a directory of them (a Hugging Face model folder, say), or a PyTorch
    state dict file (``.pt``, ``.pth``, ``.bin``; a folder's ``pytorch_model.bin``) read with
    ``torch.load`` with ``weights_only=True``. When None (and no ``output_dir`` model), the first worker
    to register uploads its own parameters."""

    save_dir: str | None = _flag(
        None, "checkpoint directory; the server resumes from its newest checkpoint"
    )
    """Where checkpoints go; None disables saving. On start the server resumes from the newest
    complete checkpoint found here."""

    from_checkpoint: str | None = _flag(None, "resume from this checkpoint directory")
    """Resume from this checkpoint directory instead (overrides the newest in save_dir)."""

    save_every: int = _flag(0, "save every N rounds (0: on shutdown only)")
    """Save every N rounds (0: only on shutdown and on request)."""

    keep_checkpoints: int = _flag(3, "checkpoints to keep", flag="--keep")
    """How many checkpoints to keep in ``save_dir`` (complete ones, newest by content)."""

    fresh_start: bool = _flag(
        False,
        "start from scratch when --save-dir holds checkpoints of which none loads"
        " (default: refuse to start)",
    )
    """Start from scratch when ``save_dir`` holds checkpoint folders of which none loads (they
    are left in place). Without it the server refuses to start, naming each folder and why."""

    token: str | None = _flag(
        None,
        "shared bearer token; made up and printed when the server binds beyond "
        "loopback and none is given",
        env="DILOCO_TOKEN",
    )
    """Shared secret required as ``Authorization: Bearer`` on every endpoint except /healthz
    and the dashboard's static files. None leaves the API open (fine on loopback only)."""

    admin_token: str | None = _flag(
        None, "separate token for /control/* (none: --token)", env="DILOCO_ADMIN_TOKEN"
    )
    """When set, ``/control/*`` needs this token instead of ``token`` (which is then not enough).
    It is also accepted wherever ``token`` is, so one dashboard login can watch and steer."""

    tls_cert: str | None = _flag(None, "PEM certificate chain: serve HTTPS")
    """PEM certificate chain: serve HTTPS instead of HTTP (needs ``tls_key``)."""

    tls_key: str | None = _flag(None, "PEM private key of --tls-cert")
    """PEM private key of ``tls_cert``."""

    dashboard_enabled: bool = _flag(
        True, "serve no dashboard (/ and /dashboard answer 404)", flag="--no-dashboard"
    )
    """Serve the dashboard at ``/`` and ``/dashboard``. Off, those paths and its files answer
    404 like any unknown path; ``/status`` and ``/control/*`` are served all the same."""

    auth_failure_limit: int = _flag(
        5, "failed authentications per address per minute before it gets 429 (0: no limit)"
    )
    """Failed authentications from one address within ``auth_failure_window`` after which
    further requests from it without the right token get 429, and lose their connection, until
    the window passes (0 disables the slowdown). A request with the right token always passes:
    a local process must not be able to lock the workers out by guessing."""

    auth_failure_window: float = 60.0
    """Seconds over which failed authentications are counted."""

    header_timeout: float = _flag(
        10.0,
        "close a connection that has not sent a complete request head this long "
        "after it opened or its last reply, s",
    )
    """Seconds a connection has to deliver a complete request head (request line and headers),
    counted from when it opens or its previous reply was sent; then it is closed. Also bounds the
    TLS handshake. It ends idle keep-alive connections too: clients reconnect on their next
    request, which costs one round trip."""

    max_connections: int | None = _flag(
        None, "connections served at once (default: the open-file limit, ulimit -n, less 256)"
    )
    """Open connections served at once; past it the oldest connection that has not yet shown a
    valid token is closed to make room, or, when every one has, the new one gets 503
    ``too_many_connections``. None: the process's open-file limit (``ulimit -n``, soft) less
    256 for files and checkpoints, so ``accept()`` never runs out of descriptors."""

    max_connections_per_ip: int = _flag(
        64,
        "connections from one address that have not shown the token; a new one closes the oldest",
    )
    """Connections from one address (an IPv6 /64) that have not yet shown a valid token; a new
    one past it closes that address's oldest such connection. One address cannot take every
    connection, and a process on a worker's machine cannot shut the worker out: once a
    connection carries the token it no longer counts here. Loopback is not exempt."""

    weighting: str = _flag(
        "equal",
        "average contributions equally, by the samples or by the tokens each worker reports",
        choices=("equal", "samples", "tokens"),
    )
    """How contributions are averaged: ``equal``, ``samples`` (by the samples each worker
    reports with its submission, else its steps), or ``tokens`` (sync server mode: by the
    tokens each upload says it represents, ``DiLoCoWorker.report(tokens=...)``; an upload
    without them is refused, 400 ``missing_metadata``). A reported weight must lie in [1e-6,
    1e12] (400 ``bad_metadata``)."""

    clip_norm_factor: float | None = _flag(
        None,
        "sync: clip each upload to C x the median of the round's upload norms "
        "(robust aggregation; keeps the round's uploads: one model of memory per "
        f"worker); --allreduce: leave out of a round a member whose norm is above C x the "
        f"quorum's median (default {ALLREDUCE_NORM_BOUND:g})",
        metavar="C",
    )
    """Sync: clip each upload of a round to this many times the median of the round's upload
    norms (robust aggregation; 2 to 5 is typical). None: no clipping. The server then keeps the
    round's uploads until it closes: memory grows by one model (fragment) per worker. All-reduce
    mode: a member whose pseudo-gradient norm is above this many times the quorum's median
    contributes nothing to that round (None: ``ALLREDUCE_NORM_BOUND``; ``norm_bound``)."""

    trim_fraction: float = _flag(
        0.0,
        "sync: coordinate-wise trimmed mean dropping floor(F x n) of n values at "
        "each end (0 <= F < 0.5; 0: the weighted mean; keeps the round's uploads)",
        metavar="F",
    )
    """Sync: coordinate-wise trimmed mean, dropping ``floor(trim_fraction * n)`` of the round's n
    values at each end of every coordinate (in [0, 0.5); 0: the weighted mean). Unweighted, and
    no trimming with fewer than ``1 / trim_fraction`` contributions. Keeps the round's uploads,
    as clipping does."""

    heartbeat_timeout: float = _flag(120.0, "evict a worker silent this long, s (0: never)")
    """A worker silent for this long is evicted and every barrier re-evaluated (0 disables)."""

    stuck_timeout: float = _flag(
        1800.0, "evict a worker whose loop took no step this long, s (0: never)"
    )
    """A worker whose heartbeats say its training loop took no optimizer step for this long
    (while not syncing) is evicted although its heartbeat thread still runs (0 disables). Raise
    it if your loop runs long evaluations between steps."""

    join_timeout: float = _flag(
        15.0,
        "drop a registered worker that fetches nothing and sends no heartbeat "
        "this long, s (0: never)",
    )
    """A registered worker that neither asks for the parameters nor heartbeats nor uploads
    within this many seconds (an initial upload under way counts) is taken for a ghost, a worker
    that failed while joining, and leaves the expected set, so it does not hold a round for
    ``heartbeat_timeout`` (0 disables)."""

    poll_timeout: float = _flag(30.0, "longest a parameter long-poll waits, seconds")
    """Longest a ``GET /global_params?min_round=`` waits before answering 202 (poll again).
    Workers' read timeouts must exceed it."""

    body_timeout: float = _flag(
        60.0, "drop an upload whose sender goes quiet mid-body this long, s (0: never)"
    )
    """A tensor upload whose sender sends nothing for this long mid-body is dropped (408) and
    its receive buffer goes to the next upload (0 disables). Without it a worker that dies
    mid-upload, with no FIN reaching the server, blocks every other upload."""

    min_upload_rate: float = _flag(
        64 * 1024,
        "drop an upload averaging fewer bytes/s than this over --upload-rate-"
        "window seconds of waiting for it (0: never)",
    )
    """Bytes per second a tensor upload must average over each ``upload_rate_window`` of
    waiting for its sender, else it is dropped (408 ``too_slow``) and its receive buffer goes to
    the next upload (0 disables). Catches a sender that trickles rather than stops, which
    ``body_timeout`` never sees. 64 KiB/s is half a megabit: no link that slow ships a model."""

    upload_rate_window: float = _flag(10.0, "seconds over which --min-upload-rate is averaged")
    """Seconds of waiting for the sender over which ``min_upload_rate`` is averaged: long enough
    to ride out a TCP retransmission backoff, short enough that each crawling upload ahead of a
    good one delays it by about this much."""

    upload_slots: int = _flag(
        1,
        "uploads received at once, each into a buffer of up to the model's fp32 "
        "size (half with bf16 uploads); raise it when workers reach the server "
        "over links slower than its own (1: memory flat in the number of workers,"
        " uploads queue)",
    )
    """Uploads received at once, each into an upload-sized buffer. A buffer goes to the next
    upload as soon as a body has landed, which refills it behind the add of the previous one;
    the server's own link is the shared bottleneck, so 1 costs little time."""

    codecs: str = _flag(
        ",".join(codec_names()),
        "comma-separated codecs workers may upload with (default: all)",
        metavar="NAMES",
    )
    """Codecs workers may upload with (``fp32,bf16,int8,int4,lowrank``: all by default). A worker
    asking for another is refused at registration (422 ``codec_refused``), as is an upload;
    raw uploads count as ``fp32`` or ``bf16`` by their dtype."""

    download_codec: str = _flag(
        "fp32",
        "publish each round as an update of the previous one in this codec (sync mode, "
        "workers apply it bit for bit; joiners and workers that missed a round get full "
        "parameters); fp32: full parameters every round",
        choices=DOWNLOAD_CODECS,
    )
    """How rounds reach the workers. ``fp32``: full parameters, as always. ``bf16``, ``int8``,
    ``int4``: a worker that holds the previous round downloads the round's change, quantized
    with the server's error feedback, and applies it with the same arithmetic as the server, so
    every replica stays bit-identical to ``GET /global_params`` (docs/design/codecs.md).
    The server then keeps one more fp32 copy of the model. ``sparse``: under plain averaged
    descent (``outer_rule="sparseloco"`` or ``outer_momentum=0``) a worker downloads the
    positions the round changed with their new values, copied as they are (no true copy; full
    parameters for a round where that is not smaller). Sync mode only, without fragments."""

    max_initial_bytes: int = 64 * 1024**3
    """Largest parameter upload accepted before the model is known."""

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

    @property
    def allowed_codecs(self) -> tuple[str, ...]:
        """``codecs`` as names."""
        return tuple(n.strip() for n in self.codecs.split(",") if n.strip())

    @property
    def lossy_download(self) -> bool:
        """Rounds are published as updates (``download_codec`` other than ``fp32``; ``sparse``
        included, though it loses nothing)."""
        return self.download_codec != "fp32"

    @property
    def sparse_download(self) -> bool:
        """Rounds are published as sparse updates (``download_codec="sparse"``)."""
        return self.download_codec == SPARSE_UPDATE

    @property
    def keeps_true_copy(self) -> bool:
        """The outer step has a copy of its own (a lossy download codec other than sparse)."""
        return self.lossy_download and not self.sparse_download

    @property
    def norm_bound(self) -> float:
        """All-reduce mode: the factor over the quorum's median norm above which a member is
        left out of a round (``Registered.norm_bound``)."""
        if self.clip_norm_factor is not None:
            return self.clip_norm_factor
        return ALLREDUCE_NORM_BOUND

    @property
    def robust(self) -> bool:
        """Robust aggregation is on: sync rounds keep their uploads (``clip_norm_factor``,
        ``trim_fraction``)."""
        return self.clip_norm_factor is not None or self.trim_fraction > 0

    def __post_init__(self) -> None:
        if (
            self.output_dir is not None
            and self.save_dir is None
            and not self.allreduce
            and not self.swarm
        ):
            # -o's checkpoint half, resolved once here: everything after reads save_dir.
            object.__setattr__(self, "save_dir", str(Path(self.output_dir) / "checkpoints"))
        # The reference's async command line: a buffer size turns Delayed Nesterov on, 0 turns
        # it off. Read that way, so that its command does not run plain Nesterov in silence.
        if self.dn_buffer_size == 0:
            if self.delayed_nesterov:
                raise ValueError(
                    "dn_buffer_size 0 turns Delayed Nesterov off; it cannot go with "
                    "delayed_nesterov (drop one of --dn-buffer-size 0, --delayed-nesterov)"
                )
            object.__setattr__(self, "dn_buffer_size", None)
        elif self.dn_buffer_size is not None and self.dn_buffer_size > 0:
            object.__setattr__(self, "delayed_nesterov", True)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 1 <= self.min_workers <= self.num_workers:
            raise ValueError(f"min_workers must be in [1, num_workers], got {self.min_workers}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite positive number, got {self.outer_lr}")
        self._check_outer_rule()
        if self.weighting not in ("equal", "samples", "tokens"):
            raise ValueError(
                f"weighting must be 'equal', 'samples' or 'tokens', got {self.weighting!r}"
            )
        if self.weighting == "tokens" and (self.allreduce or self.swarm):
            raise ValueError(
                "weighting='tokens' weights the uploads of server mode; all-reduce and swarm "
                "members weigh by samples (--weighting samples)"
            )
        if self.save_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("save_every must be >= 0 and keep_checkpoints >= 1")
        if self.save_every and self.save_dir is None and not (self.allreduce or self.swarm):
            # Accepted, it would save nothing: a run that believes it can survive a crash.
            raise ValueError(
                f"save_every {self.save_every} needs save_dir (--save-dir DIR, or -o DIR): without a "
                "place to save, no checkpoint would be written"
            )
        for name in ("heartbeat_timeout", "stuck_timeout", "join_timeout", "body_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.poll_timeout > 0:
            raise ValueError("poll_timeout must be positive")
        if self.upload_slots < 1:
            raise ValueError("upload_slots must be >= 1")
        unknown = [n for n in self.allowed_codecs if n not in codec_names()]
        if unknown or not self.allowed_codecs:
            raise ValueError(
                f"codecs must name some of {', '.join(codec_names())}, got {self.codecs!r}"
            )
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        policy_named(self.staleness_weighting, self.staleness_cutoff)  # ValueError if unfit
        if self.mode == "sync" and (
            self.delayed_nesterov
            or self.max_staleness is not None
            or self.staleness_weighting != "none"
        ):
            raise ValueError(
                "delayed_nesterov (also turned on by dn_buffer_size), max_staleness and "
                "staleness_weighting need mode='async' (--async)"
            )
        if self.mode == "async" and self.weighting != "equal":
            raise ValueError(
                f"weighting={self.weighting!r} averages one round's contributions; async mode "
                "has no rounds (weight by age with --staleness-weighting)"
            )
        if self.clip_norm_factor is not None and not (
            math.isfinite(self.clip_norm_factor) and self.clip_norm_factor > 0
        ):
            raise ValueError(f"clip_norm_factor must be positive, got {self.clip_norm_factor}")
        if not (math.isfinite(self.trim_fraction) and 0 <= self.trim_fraction < 0.5):
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.mode == "async" and self.robust:
            raise ValueError(
                "clip_norm_factor and trim_fraction aggregate one round's uploads; "
                "async mode has no rounds"
            )
        self._check_download_codec()
        self._check_quorum()
        self._check_allreduce()
        self._check_swarm()
        self._check_relay()
        buffer = self.dn_buffer_size if self.dn_buffer_size is not None else self.num_workers
        if buffer < 1:
            raise ValueError(f"dn_buffer_size must be >= 1, got {self.dn_buffer_size}")
        if not (math.isfinite(self.dn_activation) and 0 <= self.dn_activation <= 1 / buffer):
            raise ValueError(
                f"dn_activation must be in [0, 1/N] = [0, {1 / buffer:.4g}], got {self.dn_activation}"
            )
        if self.dylu_min_sync_every < 1:
            raise ValueError("dylu_min_sync_every must be >= 1")
        if self.dylu_base_sync_every is not None:
            if self.dylu_base_sync_every < 1:
                raise ValueError(
                    f"dylu_base_sync_every must be >= 1, got {self.dylu_base_sync_every}"
                )
            if not self.dylu:
                # Accepted alone it would do nothing: the reference's command line gives both.
                raise ValueError("dylu_base_sync_every (--dylu-base-sync-every) needs --dylu")
        if self.num_fragments is not None and self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}")
        if self.fragment_pattern not in (None, *PATTERNS):
            raise ValueError(
                f"fragment_pattern must be 'sequential' or 'strided', got {self.fragment_pattern!r}"
            )
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token must be at least 8 characters")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin_token must be at least 8 characters")
        if self.admin_token is not None and self.admin_token == self.token:
            raise ValueError("admin_token must differ from token, or it guards nothing")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.auth_failure_limit < 0:
            raise ValueError(f"auth_failure_limit must be >= 0, got {self.auth_failure_limit}")
        if not (math.isfinite(self.auth_failure_window) and self.auth_failure_window > 0):
            raise ValueError(
                f"auth_failure_window must be a finite positive number, got {self.auth_failure_window}"
            )
        for name in ("header_timeout", "upload_rate_window"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number, got {value}")
        if not (math.isfinite(self.min_upload_rate) and self.min_upload_rate >= 0):
            raise ValueError(
                f"min_upload_rate must be a finite number >= 0, got {self.min_upload_rate}"
            )
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_ip < 1:
            raise ValueError(
                f"max_connections_per_ip must be >= 1, got {self.max_connections_per_ip}"
            )

    def _check_outer_rule(self) -> None:
        """Resolve ``outer_momentum`` from the rule (``core/outer_rules.py``), refusing what
        contradicts it."""
        check_rule(self.outer_rule)
        momentum = outer_momentum(self.outer_rule, self.outer_momentum)
        if not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {momentum}")
        object.__setattr__(self, "outer_momentum", momentum)
        if self.outer_rule == SPARSELOCO and self.delayed_nesterov:
            raise ValueError(
                "outer_rule sparseloco (--outer-rule sparseloco) keeps no outer momentum; it "
                "cannot go with delayed_nesterov (--delayed-nesterov, --dn-buffer-size)"
            )

    @property
    def momentum(self) -> float:
        """``outer_momentum`` as resolved at construction (never None then)."""
        assert self.outer_momentum is not None
        return self.outer_momentum

    def _check_download_codec(self) -> None:
        if self.download_codec not in DOWNLOAD_CODECS:
            raise ValueError(
                f"download_codec (--download-codec) must be one of {', '.join(DOWNLOAD_CODECS)}, "
                f"got {self.download_codec!r}"
            )
        if not self.lossy_download:
            return
        if self.mode == "async":
            raise ValueError(
                f"download_codec={self.download_codec!r} (--download-codec) needs sync mode "
                "(mode='sync', no --async): an update takes a "
                "worker from one published round to the next, and in async mode a worker is "
                "rarely exactly one version behind, so it would download full parameters anyway; "
                "use --download-codec fp32 in async mode"
            )
        if self.num_fragments is not None and self.num_fragments > 1:
            raise ValueError(
                f"download_codec={self.download_codec!r} (--download-codec) publishes updates of "
                "the whole model; "
                "streaming fragments are downloaded piece by piece as full values: drop "
                "--num-fragments or use --download-codec fp32"
            )
        # Delayed Nesterov needs async mode, refused above.
        if self.sparse_download and self.momentum > 0:
            raise ValueError(
                "download_codec='sparse' (--download-codec sparse) needs plain averaged descent, "
                "whose step leaves every parameter its round's uploads did not touch unchanged: "
                "use --outer-rule sparseloco (or --outer-momentum 0)"
            )

    def _check_quorum(self) -> None:
        quorum, grace = self.quorum_value, self.grace_seconds  # parse errors are ValueErrors
        if self.max_lateness < 0:
            raise ValueError(f"max_lateness must be >= 0, got {self.max_lateness}")
        if not (math.isfinite(self.grace_ceiling) and 0 <= self.grace_floor <= self.grace_ceiling):
            raise ValueError(
                f"need 0 <= grace_floor <= grace_ceiling, got {self.grace_floor}, "
                f"{self.grace_ceiling}"
            )
        if quorum is None:
            tuned = {
                "--grace": self.grace is not None,
                "--grace-floor": self.grace_floor != GRACE_FLOOR,
                "--grace-ceiling": self.grace_ceiling != GRACE_CEILING,
                "--max-lateness": self.max_lateness != 1,
            }
            given = [flag for flag, on in tuned.items() if on]
            if given:
                raise ValueError(f"{', '.join(given)} need --quorum (quorum rounds)")
            return
        if isinstance(quorum, int) and quorum < self.min_workers:
            raise ValueError(f"quorum {quorum} is below min_workers ({self.min_workers})")
        if grace is not None and (
            self.grace_floor != GRACE_FLOOR or self.grace_ceiling != GRACE_CEILING
        ):
            raise ValueError("--grace-floor and --grace-ceiling bound --grace auto only")
        clashes = {
            "--async": (self.mode == "async", "async mode has no rounds to close"),
            "--allreduce": (self.allreduce, "its quorums are formed before the round"),
            "--swarm": (self.swarm, "its stages run their own quorums"),
            "--num-fragments": (
                (self.num_fragments or 1) > 1,
                "streaming fragments keep the barrier (each fragment's round waits for all)",
            ),
        }
        refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
        if refused:
            raise ValueError("--quorum cannot go with " + "; ".join(refused))
        # The fragmenting is otherwise the first worker's choice: fixed at one unit here, so a
        # streaming worker is told at registration (409 fragments_mismatch), not mid-run.
        object.__setattr__(self, "num_fragments", 1)

    @property
    def quorum_value(self) -> int | float | None:
        """``quorum`` parsed: a count (int), a fraction (float), or None (the full barrier)."""
        return None if self.quorum is None else parse_quorum(self.quorum)

    @property
    def grace_seconds(self) -> float | None:
        """``grace`` parsed: seconds, or None for ``auto`` (and without ``quorum``)."""
        return None if self.grace is None else parse_grace(self.grace)

    def _check_swarm(self) -> None:
        if self.stages < 2 or self.stages > 1024:
            raise ValueError(f"stages must be in [2, 1024], got {self.stages}")
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if not self.swarm:
            return
        none_held = "the server holds no parameters in swarm mode"
        clashes = {
            "--allreduce": (self.allreduce, "one mode per server"),
            "--async": (self.mode == "async", "the server runs no rounds"),
            "--download-codec": (self.lossy_download, "nothing is published by the server"),
            "--num-fragments": (self.num_fragments is not None, "the server runs no rounds"),
            "--init": (self.initial_params is not None, none_held),
            "--output-dir": (self.output_dir is not None, none_held),
            "--save-dir": (self.save_dir is not None, none_held),
            "--from-checkpoint": (self.from_checkpoint is not None, none_held),
            "--clip-norm-factor/--trim-fraction": (self.robust, "the server averages nothing"),
            "--outer-rule sparseloco": (
                self.outer_rule == SPARSELOCO,
                "its error feedback needs lossy uploads, which the stage quorums refuse",
            ),
        }
        refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
        if refused:
            raise ValueError("--swarm (swarm=True) cannot go with " + "; ".join(refused))

    def _check_allreduce(self) -> None:
        if not (math.isfinite(self.collective_timeout) and self.collective_timeout > 0):
            raise ValueError(f"collective_timeout must be positive, got {self.collective_timeout}")
        if not self.allreduce:
            return
        none_held = "the server holds no parameters in all-reduce mode"
        clashes = {
            "--async": (self.mode == "async", "quorums are synchronous rounds"),
            "--download-codec": (self.lossy_download, "nothing is published by the server"),
            "--init": (self.initial_params is not None, none_held),
            "--output-dir": (
                self.output_dir is not None,
                f"{none_held}; give the workers --save-dir for checkpoints",
            ),
            "--save-dir": (self.save_dir is not None, none_held),
            "--from-checkpoint": (self.from_checkpoint is not None, none_held),
            "--trim-fraction": (
                self.trim_fraction > 0,
                "a collective average has no trimmed variant",
            ),
        }
        refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
        if refused:
            raise ValueError("--allreduce (allreduce=True) cannot go with " + "; ".join(refused))

    def _check_relay(self) -> None:
        if self.upstream_codec not in RELAY_CODECS:
            raise ValueError(
                f"upstream_codec must be one of {', '.join(RELAY_CODECS)}, got {self.upstream_codec!r}"
            )
        if self.upstream is None:
            return
        if not self.upstream.strip():
            raise ValueError("upstream (--upstream) must be HOST:PORT or a URL, got ''")
        from_upstream = "a relay's parameters come from the upstream server"
        clashes = {
            "--allreduce": (self.allreduce, "a relay averages its region's uploads itself"),
            "--swarm": (self.swarm, "a relay runs rounds"),
            "--async": (self.mode == "async", "a relay closes one round per upstream round"),
            "--num-fragments": (
                self.num_fragments is not None and self.num_fragments > 1,
                "a relay sends the whole model upstream each round",
            ),
            "--download-codec": (self.lossy_download, "a relay publishes full parameters"),
            "--clip-norm-factor/--trim-fraction": (self.robust, "not supported by a relay yet"),
            "--outer-rule sparseloco": (
                self.outer_rule == SPARSELOCO,
                "the outer rule is the upstream's",
            ),
            "--init": (self.initial_params is not None, from_upstream),
            "--from-checkpoint": (
                self.from_checkpoint is not None,
                "a relay resumes from its own --save-dir",
            ),
        }
        refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
        if refused:
            raise ValueError("--upstream (a relay) cannot go with " + "; ".join(refused))
        # Whole-model rounds, fixed now: a worker that asks for fragments is refused at
        # registration (409 fragments_mismatch) instead of splitting the relay's rounds.
        object.__setattr__(self, "num_fragments", 1)
