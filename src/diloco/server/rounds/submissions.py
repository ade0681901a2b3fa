"""What the server answers an upload its aggregator will not simply take: a retry of one already
counted (the ``UploadReceipt`` of a duplicate), and the 409 replies a worker acts on (rebase,
continue, wait, retry). Pure functions of their arguments; the upload's metadata is an
``UploadMeta`` (``diloco.wire.messages``).
"""

from __future__ import annotations

from diloco.server.errors import ApiError, conflict
from diloco.server.rounds.aggregator import Check, Verdict
from diloco.wire.messages import UploadReceipt

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
    check: Check, submission_id: str, instance: str, versions: bool, fragment: int | None
) -> UploadReceipt:
    """Not an error: a retry of an upload that was already counted. Say where it went
    (``versions``: async, whose reply also names the version it made)."""
    counted = check.counted_in
    assert counted is not None, "a duplicate was counted somewhere"
    return UploadReceipt(
        status="duplicate",
        round=counted,
        version=counted + 1 if versions else None,
        submission_id=submission_id,
        instance=instance,
        fragment=fragment,
    )


def refusal(check: Check, base: int, fragment: int | None) -> ApiError:
    """The 409 for every verdict but ACCEPT, DUPLICATE and TOO_STALE."""
    v, now = check.verdict, check.round
    detail = _DETAILS[v].format(base=base, now=now, next=now + 1)
    return conflict(v.value, detail, round=now, action=_ACTIONS[v], fragment=fragment)
