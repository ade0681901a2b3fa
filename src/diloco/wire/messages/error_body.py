"""The body of every error reply: ``{"error": code, "detail": sentence}``, and what a worker
acts on (docs/design.md, "Errors"): a 409 adds ``round`` and ``action``, some codes more.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.wire.messages.codec import MessageError, Reply, spec

ACTIONS = ("rebase", "continue", "wait", "retry", "reconfigure", "rejoin")
"""What a 409 tells the worker to do: rebase onto the current parameters, keep training on the
same snapshot, wait for the round's result, send again shortly, restart with the run's
settings, register again (and join with weight 0)."""


@dataclass(frozen=True, kw_only=True)
class ErrorBody(Reply):
    """Any reply with an error status (4xx, 5xx)."""

    error: str
    """The machine-readable code (``stale_round``, ``bad_field``, ``unknown_worker``...)."""
    detail: str = ""
    """A sentence for a person: what was wrong, and what to do."""
    round: int | None = spec(default=None, omit=True)
    """409: the server's round (of the unit the request named)."""
    action: str | None = spec(default=None, omit=True)
    """409: one of ``ACTIONS``."""
    staleness: int | None = spec(default=None, omit=True)
    """409 ``too_stale`` (async): updates applied since the upload's base."""
    fragment: int | None = spec(default=None, omit=True)
    """409, streaming: the fragment the upload named."""
    fragments: int | None = spec(default=None, omit=True)
    """409 ``fragments_mismatch``: the run's number of fragments."""
    fragment_pattern: str | None = spec(default=None, omit=True)
    """409 ``fragments_mismatch``: the run's fragment pattern."""
    allowed: tuple[str, ...] | None = spec(default=None, omit=True)
    """422 ``codec_refused``: the codecs the server takes."""

    @classmethod
    def of(cls, data: object, fallback: str = "http_error") -> ErrorBody:
        """An error reply as far as it can be read: a body that is not one (a proxy's page,
        a field of the wrong type) keeps its code and detail when they are strings."""
        try:
            return cls.from_json(data)
        except MessageError:
            raw = data if isinstance(data, dict) else {}
            code, detail = raw.get("error"), raw.get("detail")
            return cls(
                error=code if isinstance(code, str) else fallback,
                detail=detail if isinstance(detail, str) else "",
            )
