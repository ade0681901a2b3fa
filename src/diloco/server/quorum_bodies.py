"""The bodies of ``POST /quorum`` (``Ask``) and ``POST /quorum/outcome`` (``Outcome``) in
all-reduce mode, read and checked (400 ``bad_field``) before anything changes; what the server
does with them is ``server/allreduce/quorum_book.py``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.server.errors import bad_request

HASH_LIMIT = 256
ERROR_LIMIT = 500


@dataclass(frozen=True)
class Ask:
    """A ``POST /quorum``: the state the worker holds (``round``, ``hash``). It holds state
    when ``has_state`` and the hash is not empty; otherwise it must receive the run's."""

    worker_id: str
    round: int
    hash: str
    has_state: bool

    @property
    def holds(self) -> bool:
        return self.has_state and bool(self.hash)


@dataclass(frozen=True)
class Outcome:
    """A ``POST /quorum/outcome``: ``round`` and ``hash`` of the state after the step when
    ``ok``; ``error`` when not."""

    worker_id: str
    quorum_id: str
    ok: bool
    round: int | None
    hash: str
    error: str


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request("bad_field", f"{key!r} must be an integer >= 0")
    return value


def _str(body: dict[str, Any], key: str, limit: int, *, empty: bool = True) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or len(value) > limit or not (empty or value):
        raise bad_request("bad_field", f"{key!r} must be a string of at most {limit} characters")
    return value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise bad_request("bad_field", f"{key!r} must be a boolean")
    return value


def read_ask(body: dict[str, Any]) -> Ask:
    """``{"worker_id", "round", "hash", "has_state"?}`` (``has_state`` defaults to a hash
    being given); 400 ``bad_field`` otherwise."""
    hash_ = _str(body, "hash", HASH_LIMIT)
    return Ask(
        _str(body, "worker_id", 256, empty=False),
        _int(body, "round"),
        hash_,
        _bool(body, "has_state", bool(hash_)),
    )


def read_outcome(body: dict[str, Any]) -> Outcome:
    """``{"worker_id", "quorum_id", "ok", "round", "hash"}`` when ok, ``{..., "ok": false,
    "error"}`` when not (a longer error is cut, not refused); 400 ``bad_field`` otherwise."""
    ok = body.get("ok")
    if not isinstance(ok, bool):
        raise bad_request("bad_field", "'ok' must be a boolean")
    error = body.get("error", "")
    return Outcome(
        _str(body, "worker_id", 256, empty=False),
        _str(body, "quorum_id", 256, empty=False),
        ok,
        _int(body, "round") if ok else None,
        _str(body, "hash", HASH_LIMIT, empty=not ok),
        error[:ERROR_LIMIT] if isinstance(error, str) else str(error)[:ERROR_LIMIT],
    )
