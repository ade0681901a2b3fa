"""``GET /metrics``: the server's state in the Prometheus text format (version 0.0.4).

Built from ``coordinator.status()`` plus the few counters only the HTTP layer sees (requests by
status, refused authentications). Keys of the status are read with ``.get``: the coordinator
grows new fields (async mode, fragments) and a missing one must drop a line, not the endpoint.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class HttpCounters:
    """What the HTTP layer counts: responses by status code, refused authentications."""

    responses: Counter[int] = field(default_factory=Counter)
    auth_failures: Callable[[], int] = lambda: 0
    auth_refused: Callable[[], int] = lambda: 0

    def middleware(self) -> Middleware:
        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                self.responses[exc.status] += 1
                raise
            self.responses[response.status] += 1
            return response

        return count


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


def render(status: dict[str, Any], counters: HttpCounters | None = None) -> str:
    """The exposition text for one ``status()`` snapshot."""
    out = _Writer()
    workers = status.get("workers") or []
    opt = status.get("outer_optimizer") or {}
    staleness = status.get("staleness") or {}
    out.family(
        "diloco_info",
        "gauge",
        "Constant 1, labelled with the server's mode and instance.",
        [({"mode": str(status.get("mode", "sync")), "instance": str(status.get("instance"))}, 1)],
    )
    out.one(
        "diloco_uptime_seconds",
        "gauge",
        "Seconds since the server started.",
        status.get("uptime_s"),
    )
    out.one(
        "diloco_round", "gauge", "Current round (outer steps applied so far).", status.get("round")
    )
    out.one(
        "diloco_round_duration_seconds",
        "gauge",
        "Wall time of the last closed round.",
        status.get("last_round_time_s"),
    )
    out.one(
        "diloco_upload_slots",
        "gauge",
        "Uploads the server receives at once.",
        status.get("upload_slots"),
    )
    out.one(
        "diloco_uploads_waiting",
        "gauge",
        "Uploads queued for a free upload slot now.",
        status.get("uploads_waiting"),
    )
    out.one(
        "diloco_last_round_upload_wait_max_seconds",
        "gauge",
        "Longest wait of one upload for a free upload slot in the last closed round.",
        status.get("last_round_upload_wait_max_s"),
    )
    out.one(
        "diloco_last_round_contributions",
        "gauge",
        "Pseudo-gradients averaged in the last closed round.",
        status.get("last_round_contributions"),
    )
    out.one(
        "diloco_model_parameters",
        "gauge",
        "Parameters in the global model.",
        status.get("num_params"),
    )
    out.one(
        "diloco_model_bytes", "gauge", "Bytes of the fp32 global model.", status.get("model_bytes")
    )
    out.one("diloco_bytes_in_total", "counter", "Tensor bytes received.", status.get("bytes_in"))
    out.one("diloco_bytes_out_total", "counter", "Tensor bytes sent.", status.get("bytes_out"))
    out.one("diloco_workers_live", "gauge", "Registered workers.", len(workers))
    out.one(
        "diloco_workers_expected", "gauge", "Workers the run expects.", status.get("num_workers")
    )
    out.one(
        "diloco_workers_min",
        "gauge",
        "Fewest contributions a round closes with.",
        status.get("min_workers"),
    )
    out.one(
        "diloco_worker_deaths_total",
        "counter",
        "Workers evicted as silent or stuck.",
        status.get("worker_deaths"),
    )
    out.one(
        "diloco_registrations_total",
        "counter",
        "Registrations of new workers, re-joins after eviction or restart included.",
        status.get("registrations"),
    )
    out.one(
        "diloco_kicks_total",
        "counter",
        "Workers evicted by an operator (/control/kick_worker).",
        status.get("kicks"),
    )
    out.one(
        "diloco_rejected_submissions_total",
        "counter",
        "Submissions refused with 409.",
        status.get("rejected_submissions"),
    )
    out.one(
        "diloco_refused_updates_total",
        "counter",
        "Rounds (sync) or updates (async) refused because their result would not be finite; "
        "the parameters stayed as they were.",
        status.get("refused_updates"),
    )
    out.one("diloco_outer_lr", "gauge", "Outer learning rate.", opt.get("lr"))
    out.one("diloco_outer_momentum", "gauge", "Outer momentum.", opt.get("momentum"))
    out.family(
        "diloco_staleness",
        "gauge",
        "Staleness of accepted submissions (updates between a worker's base and the current "
        "parameters): last, mean and max.",
        [({"stat": k}, staleness.get(k)) for k in ("last", "mean", "max")],
    )
    out.one(
        "diloco_staleness_samples_total",
        "counter",
        "Submissions counted in the staleness statistics.",
        staleness.get("count"),
    )
    for key, help_ in (
        ("loss", "Last loss the worker reported."),
        ("steps_per_second", "Inner optimizer steps per second the worker reported."),
        ("last_seen_s_ago", "Seconds since the worker was last heard from."),
        ("bytes_in", "Tensor bytes received from the worker."),
        ("bytes_out", "Tensor bytes sent to the worker."),
    ):
        name = "diloco_worker_" + key.replace("_s_ago", "_seconds")
        out.family(
            name,
            "gauge",
            help_,
            [({"worker": str(w.get("worker_id"))}, w.get(key)) for w in workers],
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
