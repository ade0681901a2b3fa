"""What an upload's header says, and what the server answers when its aggregator will not take
it: the metadata fields (worker, submission id, base round, weight; the loss and steps the
worker reports) and the 409 replies a worker
acts on (rebase, continue, wait, retry). Pure functions of their arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diloco.server.errors import ApiError, bad_request, conflict
from diloco.server.rounds.aggregator import Check, Verdict

# Bounds of a reported weight (weighting='samples'). A weight multiplies an fp32 upload and the
# sum of weights divides the sum: 1e39 is a finite Python float but infinite in fp32, and
# denormal weights make the total ~0. Within these bounds every weight and any total of them is
# a normal fp32 number, which covers any count of samples or tokens one round can see
# (1e12 tokens per worker per round is far past any real run), fractions included.
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e12


@dataclass(frozen=True)
class Header:
    worker_id: str
    submission_id: str
    base: int
    weight: float
    loss: float | None = None  # the worker's last reported loss, for the loss history
    steps: int | None = None  # the worker's inner steps so far


def read_header(meta: dict[str, str], samples: bool) -> Header:
    """The submission fields of an upload's ``__metadata__`` (weight 1 unless ``samples``)."""
    worker_id = meta.get("worker_id", "")
    submission_id = meta.get("submission_id", "")
    if not worker_id or not submission_id:
        raise bad_request(
            "missing_metadata", "header __metadata__ needs worker_id and submission_id"
        )
    base = _meta_int(meta, "base_round")
    weight = _meta_weight(meta) if samples else 1.0
    loss = _meta_loss(meta)
    steps = _meta_int(meta, "steps") if "steps" in meta else None
    if steps is not None and steps < 0:
        raise bad_request("bad_metadata", "__metadata__['steps'] must be >= 0")
    return Header(worker_id, submission_id, base, weight, loss, steps)


def _meta_loss(meta: dict[str, str]) -> float | None:
    raw = meta.get("loss")
    if raw is None:
        return None
    try:
        loss = float(raw)
    except ValueError:
        loss = math.nan
    if not math.isfinite(loss):
        raise bad_request(
            "bad_metadata", f"__metadata__['loss'] must be a finite number, got {raw!r}"
        )
    return loss


def _meta_int(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except KeyError:
        raise bad_request("missing_metadata", f"header __metadata__ lacks {key!r}") from None
    except ValueError:
        raise bad_request("bad_metadata", f"__metadata__[{key!r}] must be an integer") from None


def _meta_weight(meta: dict[str, str]) -> float:
    raw = meta.get("weight", "1")
    try:
        weight = float(raw)
    except ValueError:
        raise bad_request(
            "bad_metadata", f"__metadata__['weight'] must be a number, got {raw!r}"
        ) from None
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # also NaN
        raise bad_request(
            "bad_metadata",
            f"__metadata__['weight'] must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] "
            f"(a count of samples or tokens), got {raw!r}",
        )
    return weight


_DETAILS = {
    Verdict.STALE: "computed against round {base}, the server is at round {now}; rebase onto "
    "the current parameters",
    Verdict.FUTURE: "names round {base}, the server is at round {now}; rebase onto the current "
    "parameters",
    Verdict.NOT_EXPECTED: "round {now} opened before this worker joined; keep training, it takes "
    "part from round {next}",
    Verdict.ALREADY_SUBMITTED: "this worker already contributed to round {now}; wait for its "
    "result",
    Verdict.IN_PROGRESS: "an upload from this worker is still being received; retry shortly",
    Verdict.CLOSING: "round {now} is closing; rebase onto its result",
}
_ACTIONS = {
    Verdict.STALE: "rebase",
    Verdict.FUTURE: "rebase",
    Verdict.NOT_EXPECTED: "continue",
    Verdict.ALREADY_SUBMITTED: "wait",
    Verdict.IN_PROGRESS: "retry",
    Verdict.CLOSING: "rebase",
}


def duplicate_reply(
    check: Check, submission_id: str, instance: str, versions: bool, which: dict[str, int]
) -> dict[str, Any]:
    """Not an error: a retry of an upload that was already counted. Say where it went
    (``versions``: async, whose reply also names the version it made)."""
    reply: dict[str, Any] = {
        "status": "duplicate",
        "round": check.counted_in,
        "submission_id": submission_id,
        "instance": instance,
        **which,
    }
    if versions and check.counted_in is not None:
        reply["version"] = check.counted_in + 1
    return reply


def refusal(check: Check, base: int, which: dict[str, int]) -> ApiError:
    """The 409 for every verdict but ACCEPT, DUPLICATE and TOO_STALE."""
    v, now = check.verdict, check.round
    detail = _DETAILS[v].format(base=base, now=now, next=now + 1)
    return conflict(v.value, detail, round=now, action=_ACTIONS[v], **which)
