"""The server settings for what reaches it: tokens and TLS, the bounds on connections before
authentication, how the round's uploads are averaged (robust aggregation included), the timeouts
that evict a silent worker or drop a stalled upload, and the codecs on the way up and down."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.codecs import codec_names
from diloco.core.codecs.sparse_update import SPARSE_UPDATE
from diloco.server.config.declare import ALLREDUCE_NORM_BOUND, DOWNLOAD_CODECS, _flag
from diloco.server.config.service import ServiceSettings


@dataclass(frozen=True)
class TrafficSettings(ServiceSettings):
    """Fields of ``ServerConfig`` after ``ServiceSettings``'s, in ``--help`` order."""

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
