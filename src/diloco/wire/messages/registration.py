"""Joining and staying: ``POST /register`` (``Register`` and its ``info``, answered by
``Registered``), ``POST /heartbeat`` (``Heartbeat``, ``HeartbeatReply``) and ``POST /deregister``
(``Deregister``, ``Deregistered``).

A registration reply carries what the server decides for the run, so a worker never restates
it: the mode, the fragment plan and rounds, the codecs taken, the long polls' length, DyLU's
``sync_every``; in all-reduce mode also the rendezvous, the collective timeout, the weighting
and the outer step every worker applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.fragments import PATTERNS, SEQUENTIAL
from diloco.wire.messages.codec import Reply, Request, Rule, at_least, one_of, spec, text

STAGES_LIMIT = 1024
"""Swarm mode: stages a pipeline may have (and a peer may name as fitting it)."""
Table = tuple[tuple[str, tuple[int, ...]], ...]
"""A parameter table: ``[[name, [dim, ...]], ...]`` in the model's order."""
Plan = tuple[tuple[tuple[str, str, int, int], ...], ...]
"""A fragment plan: per fragment, its pieces as ``[wire name, parameter, start, stop]`` (flat
element offsets into the parameter)."""


def _table_ok(table: Table) -> bool:
    names = [name for name, _ in table]
    return (
        bool(table)
        and all(names)
        and len(set(names)) == len(names)
        and all(d >= 0 for _, shape in table for d in shape)
    )


TABLE = Rule(
    "a non-empty list of [name, [dim, ...]] with distinct non-empty names and dims >= 0",
    _table_ok,
)
STAGES = Rule(
    f"a non-empty list of at most {STAGES_LIMIT} distinct stage indices >= 0",
    lambda v: 0 < len(v) <= STAGES_LIMIT and len(set(v)) == len(v) and min(v) >= 0,
)
CODEC = Rule(
    "an object of strings with a 'codec' key, as codec_metadata(codec) gives "
    "({'codec': 'int8', 'codec_block': '64'})",
    lambda asked: "codec" in asked,
)


@dataclass(frozen=True)
class RegisterInfo(Request):
    """What a registering worker says about itself and the way it syncs (``Register.info``).
    Every key may be left out; ``fragmenting`` says what the server assumes then."""

    pid: int | None = spec(default=None, omit=True)
    """The worker's process id, for an operator reading the logs."""
    device: str | None = spec(default=None, omit=True)
    """Where the worker trains (``cpu``, ``cuda:0``)."""
    sync_every: int | None = spec(default=None, rule=at_least(1), omit=True)
    """Its inner steps between syncs: DyLU's base for the ``recommended_sync_every`` it gets."""
    heartbeat_interval: float | None = spec(default=None, rule=at_least(0, "a number"), omit=True)
    """Seconds between its heartbeats (0: none). All-reduce mode leaves a member of a failed
    quorum that stays silent for two intervals out of the next quorum."""
    num_fragments: int | None = spec(default=None, rule=at_least(1), omit=True)
    """Streaming DiLoCo: the fragments it syncs in (absent: 1, the whole model at once)."""
    fragment_pattern: str | None = spec(default=None, rule=one_of(PATTERNS), omit=True)
    """How the model is cut into fragments (absent: ``sequential``)."""
    codec: dict[str, str] | None = spec(default=None, rule=CODEC, omit=True)
    """The codec of its uploads as ``codec_metadata(codec)`` (absent: raw fp32/bf16 tensors),
    checked at registration so a refused one is told now, not mid-run."""
    params: Table | None = spec(default=None, rule=TABLE, omit=True)
    """Its parameter table. All-reduce mode requires it (the first registrant's is the run's,
    and a worker whose table differs is refused before it enters a collective)."""
    stages: tuple[int, ...] | None = spec(default=None, rule=STAGES, omit=True)
    """Swarm mode: the pipeline stages that fit the peer (its memory); absent: any."""
    region: int | None = spec(default=None, rule=at_least(0), omit=True)
    """A regional relay (``diloco server --upstream``): the workers of its region when it last
    registered (it registers again when that changes); absent: an ordinary worker."""

    @property
    def fragmenting(self) -> tuple[int, str]:
        """(number of fragments, pattern) the worker asks for."""
        return self.num_fragments or 1, self.fragment_pattern or SEQUENTIAL


@dataclass(frozen=True)
class Register(Request):
    """``POST /register``: join the run, or join it again under the same id (after a 410)."""

    worker_id: str | None = spec(default=None, rule=text(), omit=True)
    """The id to register under; absent, the server makes one up."""
    hostname: str | None = spec(default=None, rule=text(), omit=True)
    """Shown in the status; absent, the address the request came from."""
    info: RegisterInfo = spec(factory=RegisterInfo)
    """What the worker says about itself."""
    last_submission_id: str | None = spec(default=None, rule=text(), omit=True)
    """A re-registration's last upload whose result the worker never adopted: the reply says
    whether the server counted it (``Registered.last_submission``)."""


@dataclass(frozen=True)
class LastSubmission(Reply):
    """What the server knows of a re-registering worker's last upload."""

    counted_in: int | None
    """The round it was counted in; None: not counted (or forgotten)."""
    in_params: bool
    """That round's result is in the parameters the server serves."""


@dataclass(frozen=True)
class Rendezvous(Reply):
    """Where the members of an all-reduce quorum meet: the key/value store the server serves
    on its own authenticated HTTP API (``messages/rendezvous.py``), never an open port."""

    path: str
    """The routes' common path on the server the worker registered with (``/rendezvous``):
    each op is ``POST <path>/<op>``."""


@dataclass(frozen=True)
class OuterStep(Reply):
    """All-reduce mode: the outer optimizer every worker applies identically (SGD)."""

    lr: float
    """Outer learning rate."""
    momentum: float
    """Outer momentum (0: none)."""
    nesterov: bool
    """Nesterov momentum (when momentum > 0)."""


@dataclass(frozen=True, kw_only=True)
class Registered(Reply):
    """The reply to ``Register``: the worker's id and what the server decides for the run.
    The server writes every field but those marked absent; a reader requires only what a
    worker cannot join without (None, or empty: the server did not say)."""

    worker_id: str
    """The id the worker is registered under."""
    round: int
    """The run's round (all-reduce mode: of the state the workers hold)."""
    mode: str
    """``sync``, ``async`` or ``allreduce``: which strategy family the worker runs."""
    instance: str | None = None
    """This server life's id (None while it has no parameters, in server mode)."""
    has_params: bool
    """The server holds parameters; if not, the worker uploads its own as the initial ones."""
    num_workers: int | None = None
    """Workers the run expects (round 0, or a fresh all-reduce run's first quorum, waits for
    them)."""
    poll_timeout: float | None = None
    """Seconds a long poll (a download, a quorum ask) waits before the server answers 202:
    the worker's read timeout must outlast it."""
    codecs: tuple[str, ...] = ()
    """The codecs the server takes."""
    fragments: Plan | None = None
    """The fragment plan a streaming worker must use; None in plain DiLoCo (or before the
    server has parameters)."""
    fragment_rounds: tuple[int, ...] | None = None
    """Each fragment's round; None in plain DiLoCo."""
    outer_rule: str | None = spec(default=None, omit=True)
    """Server mode: the outer rule, ``sgd`` or ``sparseloco`` (``core/outer_rules.py``); under
    ``sparseloco`` a lossy codec's error feedback decays unless the worker set its decay.
    Absent (a server before the rule): ``sgd``."""
    recommended_sync_every: int | None = spec(default=None, omit=True)
    """DyLU: the worker's ``sync_every`` from its speed relative to the fastest (absent with
    DyLU off, or without a ``sync_every`` in the registration)."""
    last_submission: LastSubmission | None = spec(default=None, omit=True)
    """Present when the registration named ``last_submission_id``."""
    params: Table | None = spec(default=None, omit=True)
    """The run's parameter table: the server's parameters (server mode, once it has them), the
    first registrant's (all-reduce mode)."""
    rendezvous: Rendezvous | None = spec(default=None, omit=True)
    """All-reduce mode: where the quorums meet."""
    collective_timeout: float | None = spec(default=None, omit=True)
    """All-reduce mode: seconds a collective may wait for a member."""
    weighting: str | None = spec(default=None, omit=True)
    """``equal`` (each contribution weighs 1), ``samples`` (its reported samples) or, in server
    mode, ``tokens`` (its reported tokens: a worker that reports none cannot sync)."""
    outer: OuterStep | None = spec(default=None, omit=True)
    """All-reduce mode: the outer step every worker applies."""
    norm_bound: float | None = spec(default=None, omit=True)
    """All-reduce mode: a member whose pseudo-gradient norm is above this many times the
    quorum's median norm contributes nothing that round (``--clip-norm-factor``, else the
    mode's default)."""

    stage: int | None = spec(default=None, omit=True)
    """Swarm mode: the pipeline stage the peer hosts (it builds only that one); its stage sync
    runs with that stage's replicas, and its rank 0 saves under ``save_dir/stage-<stage>``."""
    num_stages: int | None = spec(default=None, omit=True)
    """Swarm mode: the pipeline's stages."""

    @property
    def allreduce(self) -> bool:
        """The server runs in all-reduce mode."""
        return self.mode == "allreduce"

    @property
    def quorum_sync(self) -> bool:
        """The workers average among themselves in the server's quorums: all-reduce mode, or
        swarm mode (each stage's replicas, with their stage's quorums)."""
        return self.mode in ("allreduce", "swarm")


DIRECTIONS = ("forward", "backward")
"""Which way a boundary's tensors travel: activations head to tail, their gradients back."""
COUNT = Rule(f"an integer in [0, {2**62}]", lambda v: 0 <= v <= 2**62)
BOUNDARIES_LIMIT = 2 * STAGES_LIMIT


@dataclass(frozen=True)
class BoundaryTraffic(Request):
    """Bytes a peer SENT across one stage boundary in one direction, and the tokens they
    carried (counted by the sender only, so that a sum over peers counts each byte once)."""

    boundary: int = spec(rule=at_least(0))
    """Boundary ``b`` lies between stage ``b`` and stage ``b + 1``."""
    direction: str = spec(rule=one_of(DIRECTIONS))
    """``forward`` (activations) or ``backward`` (their gradients)."""
    bytes: int = spec(rule=COUNT)
    """Body bytes sent so far."""
    tokens: int = spec(rule=COUNT)
    """Tokens those bodies carried (elements of the leading dims the model calls tokens)."""


@dataclass(frozen=True)
class SwarmBeat(Request):
    """Swarm mode: a peer's measurements, cumulative since it started (``Heartbeat.swarm``)."""

    throughput: float | None = spec(default=None, rule=at_least(0, "a number"), omit=True)
    """Samples per second its stage processed lately: the coordinator's bottleneck measure."""
    boundaries: tuple[BoundaryTraffic, ...] = spec(
        default=(),
        rule=Rule(f"at most {BOUNDARIES_LIMIT} entries", lambda v: len(v) <= BOUNDARIES_LIMIT),
        omit=True,
    )
    """What it sent across each boundary and direction."""
    reroutes: int = spec(default=0, rule=COUNT, omit=True)
    """Stage calls it re-sent to another replica (a driver)."""
    recoveries: int = spec(default=0, rule=COUNT, omit=True)
    """Re-sent calls that then succeeded (a driver)."""
    recomputes: int = spec(default=0, rule=COUNT, omit=True)
    """Held forwards run again because the replica stepped before their backward (a replica
    fed by several drivers)."""


@dataclass(frozen=True)
class Heartbeat(Request):
    """``POST /heartbeat``: the worker is alive, and what the status page shows of it. Absent
    numbers keep the last reported."""

    worker_id: str = spec(rule=text())
    """The registered worker."""
    steps_per_second: float | None = spec(default=None, omit=True)
    """Its training speed since the last heartbeat, stalls excluded (DyLU's input)."""
    loss: float | None = spec(default=None, omit=True)
    """Its last reported loss."""
    step_age_s: float | None = spec(default=None, omit=True)
    """Seconds since its training loop's last optimizer step (a hung loop is evicted)."""
    syncing: bool | None = spec(default=None, omit=True)
    """It is blocked in a sync: a silent loop is not hung."""
    swarm: SwarmBeat | None = spec(default=None, omit=True)
    """Swarm mode: what the peer measured of its stage and its calls since it started."""


@dataclass(frozen=True, kw_only=True)
class HeartbeatReply(Reply):
    """The reply to ``Heartbeat``."""

    status: str = "ok"
    """Always ``ok``."""
    round: int | None = None
    """The run's round."""
    outer_rule: str | None = spec(default=None, omit=True)
    """Server mode: the outer rule, ``sgd`` or ``sparseloco`` (``core/outer_rules.py``); under
    ``sparseloco`` a lossy codec's error feedback decays unless the worker set its decay.
    Absent (a server before the rule): ``sgd``."""
    recommended_sync_every: int | None = spec(default=None, omit=True)
    """DyLU: the worker's ``sync_every`` now (absent with DyLU off)."""
    move_to: int | None = spec(default=None, omit=True)
    """Swarm mode: the coordinator moved this peer to that stage (a stage's last replica left):
    it registers again for it, builds it, restores it and says ready there (absent: stay)."""


@dataclass(frozen=True)
class Deregister(Request):
    """``POST /deregister``: the worker leaves the run."""

    worker_id: str = spec(rule=text())
    """The registered worker."""


@dataclass(frozen=True, kw_only=True)
class Deregistered(Reply):
    """The reply to ``Deregister``."""

    status: str = "ok"
    """Always ``ok``."""
    round: int | None = None
    """The run's round."""
