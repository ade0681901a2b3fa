"""The records a status is made of (``server/observe/status.py`` puts them together): each a
frozen dataclass whose fields are JSON keys. The parts of the server that keep such a record
(the run log, the loss history, an aggregator's public state, the quorum book) build it
themselves, so they import this module and never the status.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OMIT = "omit_when_none"
"""Field metadata: the key is left out of the JSON while the value is ``None``."""


@dataclass(frozen=True)
class OuterOptimizer:
    lr: float
    momentum: float | None = field(default=None, metadata={OMIT: True})  # none in e.g. Adam


@dataclass(frozen=True)
class DelayedNesterovSettings:
    buffer_size: int
    activation: float


@dataclass(frozen=True)
class Staleness:
    """Of accepted submissions: updates between a worker's base and the parameters it hit."""

    last: int | None
    mean: float | None
    max: int | None
    count: int
    gated: int = 0
    """Of those, acknowledged but not applied: past the age gate (``--staleness-cutoff``)."""


@dataclass(frozen=True)
class Refusal:
    """The last round (sync) or update (async) refused for a non-finite result."""

    round: int
    fragment: int
    reason: str


@dataclass(frozen=True)
class RobustAggregation:
    clip_norm_factor: float | None
    trim_fraction: float


@dataclass(frozen=True)
class SaveRecord:
    round: int
    path: str


@dataclass(frozen=True)
class UpdateEntry:
    """One applied (or refused) outer update. ``t`` is the coordinator's clock in its log and
    seconds since the server started in a status."""

    round: int
    fragment: int
    t: float
    round_time_s: float
    outer_step_s: float
    contributions: int
    bytes_in: int
    staleness: int | None = field(metadata={OMIT: True})  # async only
    weight: float | None = field(metadata={OMIT: True})  # async only
    refused: bool
    upload_wait_s: float
    upload_wait_max_s: float
    # Bytes of the uploads this update counted (headers included), and bytes sent since the
    # update before it (any unit's): the traffic of one round each way. Defaults: a document
    # from a server before them still parses.
    round_bytes_in: int = 0
    round_bytes_out: int = 0


@dataclass(frozen=True)
class WorkerLoss:
    """What one worker's upload toward a round said (``server/observe/loss_history.py``)."""

    worker_id: str
    loss: float | None
    steps: int | None  # the worker's inner steps so far


@dataclass(frozen=True)
class RoundLoss:
    """The reported losses of one round; ``t``: seconds since the server started, when the
    round's latest upload came."""

    round: int
    t: float
    mean_loss: float | None  # over the workers that reported one
    workers: tuple[WorkerLoss, ...]


@dataclass(frozen=True)
class FragmentStatus:
    """One fragment of a streaming run (its own round, barrier or gate)."""

    fragment: int
    round: int
    published_round: int
    num_params: int
    submitted: tuple[str, ...] | None = field(metadata={OMIT: True})  # sync only
    uploading: tuple[str, ...]
    closing: bool | None = field(metadata={OMIT: True})  # sync only


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    hostname: str
    registered_s_ago: float
    last_seen_s_ago: float
    steps_per_second: float | None
    loss: float | None
    submissions: int
    last_round: int | None
    bytes_in: int
    bytes_out: int
    step_age_s: float | None
    syncing: bool
    smoothed_speed: float | None
    recommended_sync_every: int | None
    staleness: int | None
    codec: str | None = None  # of its uploads (None: it asked for none and sent none yet)
    sync_every: int | None = None  # as it registered: DyLU's base for its recommendation
    # A regional relay's region size, as it registered (server/relay/); left out for a worker.
    region: int | None = field(default=None, metadata={OMIT: True})


@dataclass(frozen=True)
class UpstreamStatus:
    """A regional relay's link to its upstream server (``server/relay/upstream.py``)."""

    url: str
    relay_id: str  # its worker id at the upstream, kept across restarts
    round: int | None  # the upstream round whose parameters the relay publishes (None: not yet)
    uploads: int  # rounds whose mean the upstream counted (duplicates of a retry included once)
    last_upload_bytes: int | None  # the body of the last upload sent
    last_download_bytes: int | None  # the body of the last parameters received
    region: int  # the relay's workers now
    last_error: str | None  # the last failed call to the upstream, until one succeeds


@dataclass(frozen=True)
class LateMergeStatus:
    """An upload counted in a round after its base round closed without it."""

    round: int  # counted in
    base: int  # computed against
    worker_id: str
    weight: float  # the staleness factor it was scaled by


@dataclass(frozen=True)
class QuorumRounds:
    """Sync quorum rounds (``--quorum``) in ``GET /status``: the rule, the open round's quorum
    size and grace window in force (None until its quorum is in), and the last late merges."""

    quorum: str  # as given: a count or a fraction
    grace: str  # as given: seconds or auto
    max_lateness: int
    size: int  # the open round's quorum, in contributions
    grace_s: float | None
    late_merges: tuple[LateMergeStatus, ...]  # the last 16
    late_merges_total: int  # since the server started


@dataclass(frozen=True)
class State:
    """An aggregator's public state, for status (``server/rounds/aggregator.py``). Fields a mode
    lacks are None."""

    round: int
    uploading: tuple[str, ...]
    opened: bool | None = None
    num_workers: int | None = None
    min_workers: int | None = None
    expected: tuple[str, ...] = ()
    submitted: tuple[str, ...] | None = None
    closing: bool | None = None
    quorum_rounds: QuorumRounds | None = None  # sync with --quorum


@dataclass(frozen=True)
class Saves:
    """The server's own checkpoints: the last written, the last error, the one resumed from
    (none at all where the server holds no parameters)."""

    last_save: SaveRecord | None = None
    last_save_error: str | None = None
    resumed_from: str | None = None


@dataclass(frozen=True)
class QuorumStatus:
    """The open quorum in ``GET /status``."""

    id: str
    members: tuple[str, ...]
    round: int


@dataclass(frozen=True)
class LeftOutStatus:
    """A worker the quorums do without although it asks (``server/allreduce/suspects.py``)."""

    worker_id: str
    reason: str
    seconds_left: float | None  # None: until it registers again


@dataclass(frozen=True)
class WorkerExclusions:
    """A worker the all-reduce quorums' checks left out (``GET /status``'s
    ``excluded_rounds``): rounds in all, and in a row until now."""

    worker_id: str
    rounds: int
    in_a_row: int


@dataclass(frozen=True)
class QuorumSummary:
    """What ``GET /status`` shows of the all-reduce mode's quorums
    (``server/allreduce/quorum_book.py``)."""

    instance: str | None
    round: int
    quorum: QuorumStatus | None
    rounds_completed: int
    rounds_discarded: int
    pending_quorum: tuple[str, ...]
    left_out: tuple[LeftOutStatus, ...] = ()
    excluded_last: tuple[str, ...] = ()  # the members the last quorum with exclusions left out
    excluded_rounds: tuple[WorkerExclusions, ...] = ()
    num_params: int = 0  # elements in the run's parameter table, learned at registration


IDLE = QuorumSummary(None, 0, None, 0, 0, ())
"""The quorum part of a status where no quorum is formed (the parameter server's)."""
