"""``GET /metrics``: the server's state in the Prometheus text format (version 0.0.4).

Built from the typed ``Status`` (``server/observe/status.py``) plus the few counters only the
HTTP layer sees (requests by status, refused authentications, ``server/web/counters.py``), and a
mode's own families (``Family``, listed by its front). Fields are read as attributes, so a
renamed one fails mypy and the tests; a value that is ``None`` or not finite drops its line.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from diloco.server.observe.records import WorkerStatus
from diloco.server.observe.status import Status

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Counters(Protocol):
    """What the HTTP layer counts (``server/web/counters.py``)."""

    @property
    def responses(self) -> Counter[int]: ...
    @property
    def auth_failures(self) -> Callable[[], int]: ...
    @property
    def auth_refused(self) -> Callable[[], int]: ...


@dataclass(frozen=True)
class Family:
    """One metric family of a single sample read from a status: a mode's own (``Front
    .metric_families``), rendered beside those every mode has."""

    name: str
    kind: str
    help: str
    value: Callable[[Status], Any]
    """The sample's value, or a list of ``(labels, value)``: one sample per label set."""


QUORUM_FAMILIES = (
    Family(
        "diloco_quorum_size",
        "gauge",
        "Members of the open quorum (all-reduce mode; 0: none open).",
        lambda s: len(s.quorum.members) if s.quorum else 0,
    ),
    Family(
        "diloco_rounds_completed_total",
        "counter",
        "Quorums that completed a round (all-reduce mode).",
        lambda s: s.rounds_completed,
    ),
    Family(
        "diloco_rounds_discarded_total",
        "counter",
        "Quorums discarded: a member failed, left or missed the deadline (all-reduce mode).",
        lambda s: s.rounds_discarded,
    ),
    Family(
        "diloco_members_excluded_total",
        "counter",
        "Members the quorums' checks left out of a round's average (all-reduce mode).",
        lambda s: sum(e.rounds for e in s.excluded_rounds),
    ),
)
"""All-reduce mode's families (``server/allreduce/allreduce_front.py`` lists them)."""


def _stages(s: Status, value: Callable[[Any], Any]) -> list[tuple[dict[str, str], Any]]:
    return [({"stage": str(k.stage)}, value(k)) for k in (s.swarm.stages if s.swarm else ())]


SWARM_FAMILIES = (
    Family(
        "diloco_swarm_replicas",
        "gauge",
        "Replicas of each pipeline stage in the route table (swarm mode).",
        lambda s: _stages(s, lambda k: len(k.ready)),
    ),
    Family(
        "diloco_swarm_replicas_assigned",
        "gauge",
        "Peers assigned each pipeline stage, ready or not (swarm mode).",
        lambda s: _stages(s, lambda k: len(k.assigned)),
    ),
    Family(
        "diloco_swarm_stage_throughput",
        "gauge",
        "Samples per second each stage's replicas reported together (swarm mode).",
        lambda s: _stages(s, lambda k: k.throughput),
    ),
    Family(
        "diloco_swarm_boundary_bytes_total",
        "counter",
        "Bytes the live peers sent across each stage boundary and direction (swarm mode).",
        lambda s: [
            ({"boundary": str(b.boundary), "direction": b.direction}, b.bytes)
            for b in (s.swarm.boundaries if s.swarm else ())
        ],
    ),
    Family(
        "diloco_swarm_boundary_bytes_per_token",
        "gauge",
        "Bytes per token across each stage boundary and direction (swarm mode).",
        lambda s: [
            ({"boundary": str(b.boundary), "direction": b.direction}, b.bytes_per_token)
            for b in (s.swarm.boundaries if s.swarm else ())
        ],
    ),
    Family(
        "diloco_swarm_reroutes_total",
        "counter",
        "Stage calls the live drivers re-sent to another replica (swarm mode).",
        lambda s: s.swarm.reroutes if s.swarm else 0,
    ),
    Family(
        "diloco_swarm_recoveries_total",
        "counter",
        "Re-sent stage calls that then succeeded (swarm mode).",
        lambda s: s.swarm.recoveries if s.swarm else 0,
    ),
    Family(
        "diloco_swarm_recomputes_total",
        "counter",
        "Held forwards the live replicas ran again because a step came before their backward "
        "(swarm mode: several drivers per replica).",
        lambda s: s.swarm.recomputes if s.swarm else 0,
    ),
    Family(
        "diloco_swarm_suspects",
        "gauge",
        "Replicas reported suspect and not heard from since (swarm mode).",
        lambda s: len(s.swarm.suspects) if s.swarm else 0,
    ),
)
"""Swarm mode's families (``server/swarm/swarm_front.py`` lists them)."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _fmt(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_: str,
        samples: Iterable[tuple[dict[str, str], Any]],
    ) -> None:
        rows = [(labels, _number(v)) for labels, v in samples]
        rows = [(labels, v) for labels, v in rows if v is not None]
        if not rows:
            return
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in rows:
            assert value is not None
            tag = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{tag}}} {_fmt(value)}" if tag else f"{name} {_fmt(value)}")

    def one(self, name: str, kind: str, help_: str, value: Any) -> None:
        self.family(name, kind, help_, [({}, value)])


def render(
    status: Status, counters: Counters | None = None, families: Sequence[Family] = ()
) -> str:
    """The exposition text for one status snapshot, with a mode's own ``families``."""
    out = _Writer()
    workers = status.workers
    opt = status.outer_optimizer
    staleness = status.staleness
    out.family(
        "diloco_info",
        "gauge",
        "Constant 1, labelled with the server's mode and instance.",
        [({"mode": status.mode, "instance": str(status.instance)}, 1)],
    )
    out.one(
        "diloco_uptime_seconds",
        "gauge",
        "Seconds since the server started.",
        status.uptime_s,
    )
    out.one("diloco_round", "gauge", "Current round (outer steps applied so far).", status.round)
    out.one(
        "diloco_round_duration_seconds",
        "gauge",
        "Wall time of the last closed round.",
        status.last_round_time_s,
    )
    out.one(
        "diloco_upload_slots",
        "gauge",
        "Uploads the server receives at once.",
        status.upload_slots,
    )
    out.one(
        "diloco_uploads_waiting",
        "gauge",
        "Uploads queued for a free upload slot now.",
        status.uploads_waiting,
    )
    out.one(
        "diloco_last_round_upload_wait_max_seconds",
        "gauge",
        "Longest wait of one upload for a free upload slot in the last closed round.",
        status.last_round_upload_wait_max_s,
    )
    out.one(
        "diloco_last_round_contributions",
        "gauge",
        "Pseudo-gradients averaged in the last closed round.",
        status.last_round_contributions,
    )
    out.one(
        "diloco_model_parameters",
        "gauge",
        "Parameters in the global model.",
        status.num_params,
    )
    out.one("diloco_model_bytes", "gauge", "Bytes of the fp32 global model.", status.model_bytes)
    out.one("diloco_bytes_in_total", "counter", "Tensor bytes received.", status.bytes_in)
    out.one("diloco_bytes_out_total", "counter", "Tensor bytes sent.", status.bytes_out)
    out.family(
        "diloco_round_bytes",
        "gauge",
        "Bytes of the last round (update): its uploads (up), and what was sent since the update "
        "before it (down).",
        [
            ({"direction": "up"}, status.last_round_bytes_in),
            ({"direction": "down"}, status.last_round_bytes_out),
        ],
    )
    out.family(
        "diloco_download_codec",
        "gauge",
        "Constant 1, labelled with how rounds are published (--download-codec; fp32: full "
        "parameters).",
        [({"codec": status.download_codec}, 1)],
    )
    out.family(
        "diloco_downloads_total",
        "counter",
        "Downloads sent whole: full parameters (the model or one fragment), or a round's "
        "update (a lossy --download-codec).",
        [
            ({"kind": "full"}, status.full_downloads),
            ({"kind": "update"}, status.update_downloads),
        ],
    )
    for family in families:
        value = family.value(status)
        samples = value if isinstance(value, list) else [({}, value)]
        out.family(family.name, family.kind, family.help, samples)
    out.one("diloco_workers_live", "gauge", "Registered workers.", len(workers))
    by_codec = Counter(w.codec for w in workers if w.codec is not None)
    out.family(
        "diloco_workers_by_codec",
        "gauge",
        "Registered workers by the codec of their uploads (as registered, then as last sent).",
        [({"codec": name}, n) for name, n in sorted(by_codec.items())],
    )
    out.one("diloco_workers_expected", "gauge", "Workers the run expects.", status.num_workers)
    out.one(
        "diloco_workers_min",
        "gauge",
        "Fewest contributions a round closes with.",
        status.min_workers,
    )
    out.one(
        "diloco_worker_deaths_total",
        "counter",
        "Workers evicted as silent or stuck.",
        status.worker_deaths,
    )
    out.one(
        "diloco_registrations_total",
        "counter",
        "Registrations of new workers, re-joins after eviction or restart included.",
        status.registrations,
    )
    out.one(
        "diloco_kicks_total",
        "counter",
        "Workers evicted by an operator (/control/kick_worker).",
        status.kicks,
    )
    out.one(
        "diloco_rejected_submissions_total",
        "counter",
        "Submissions refused with 409.",
        status.rejected_submissions,
    )
    out.one(
        "diloco_refused_updates_total",
        "counter",
        "Rounds (sync) or updates (async) refused because their result would not be finite; "
        "the parameters stayed as they were.",
        status.refused_updates,
    )
    out.one("diloco_outer_lr", "gauge", "Outer learning rate.", opt.lr if opt else None)
    out.one("diloco_outer_momentum", "gauge", "Outer momentum.", opt.momentum if opt else None)
    out.family(
        "diloco_staleness",
        "gauge",
        "Staleness of accepted submissions (updates between a worker's base and the current "
        "parameters): last, mean and max.",
        [
            ({"stat": "last"}, staleness.last),
            ({"stat": "mean"}, staleness.mean),
            ({"stat": "max"}, staleness.max),
        ],
    )
    out.one(
        "diloco_staleness_samples_total",
        "counter",
        "Submissions counted in the staleness statistics.",
        staleness.count,
    )
    quorum = status.quorum_rounds
    if quorum is not None:  # sync quorum rounds (server/rounds/quorum.py)
        out.one(
            "diloco_late_merges_total",
            "counter",
            "Uploads counted in a round after their base round closed without them.",
            quorum.late_merges_total,
        )
        out.one(
            "diloco_grace_seconds",
            "gauge",
            "The open round's grace window after its quorum (absent until the quorum is in).",
            quorum.grace_s,
        )
    per_worker: list[tuple[str, str, Callable[[WorkerStatus], Any]]] = [
        ("loss", "Last loss the worker reported.", lambda w: w.loss),
        (
            "steps_per_second",
            "Inner optimizer steps per second the worker reported.",
            lambda w: w.steps_per_second,
        ),
        (
            "last_seen_seconds",
            "Seconds since the worker was last heard from.",
            lambda w: w.last_seen_s_ago,
        ),
        ("bytes_in", "Tensor bytes received from the worker.", lambda w: w.bytes_in),
        ("bytes_out", "Tensor bytes sent to the worker.", lambda w: w.bytes_out),
    ]
    for key, help_, read in per_worker:
        out.family(
            "diloco_worker_" + key,
            "gauge",
            help_,
            [({"worker": w.worker_id}, read(w)) for w in workers],
        )
    if counters is not None:
        out.family(
            "diloco_http_responses_total",
            "counter",
            "HTTP responses by status code.",
            [({"code": str(code)}, n) for code, n in sorted(counters.responses.items())],
        )
        out.one(
            "diloco_auth_failures_total",
            "counter",
            "Requests refused for a missing or wrong token.",
            counters.auth_failures(),
        )
        out.one(
            "diloco_auth_throttled_total",
            "counter",
            "Requests refused (429) after repeated failed authentications.",
            counters.auth_refused(),
        )
    return "\n".join(out.lines) + "\n"
