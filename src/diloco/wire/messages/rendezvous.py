"""All-reduce mode's rendezvous, served by the server's authenticated HTTP API: the key/value
calls a quorum's members make while they build their process group (gloo's, or NCCL's, store
traffic), ``POST <Rendezvous.path>/<op>`` with one request class per op. Every call names the
caller and its quorum; the server answers only a member of that quorum
(``server/allreduce/rendezvous.py``). The worker's side is ``worker/allreduce/http_store.py``.

Values are bytes, carried as standard base64 strings (``encode``/``decode``); keys are short
strings. Both are bounded here, before the server stores anything.

A call names a ``position`` too (0 unless said; left out of the JSON when 0): the key space of
one rank position within the quorum, where sharded worker groups average shard with shard (rank
r of each group in a process group of its own per r).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import KW_ONLY, dataclass

from diloco.wire.messages.codec import Reply, Request, Rule, spec, text
from diloco.wire.messages.quorums import QUORUM_ID

PATH = "/rendezvous"
"""Where the server serves the ops (``Rendezvous.path`` in its replies)."""
KEY_LIMIT = 256
"""Characters of a key: gloo's are a few (``0/1``), NCCL's a few dozen."""
VALUE_LIMIT = 64 * 1024
"""Bytes of a value: gloo's address blobs are about a hundred bytes, NCCL's unique id 128."""
B64_LIMIT = (VALUE_LIMIT + 2) // 3 * 4
"""Characters of a value's base64 (``VALUE_LIMIT`` bytes)."""
WAIT_KEYS_LIMIT = 64
"""Keys one wait may name (gloo waits for one at a time)."""
WAIT_LIMIT = 3600.0
"""Seconds a wait may ask for; the server cuts it to its collective timeout."""
COUNT_LIMIT = 2**62
"""Bound of an ``add``'s amount and of a counter: far from int64's edge in libtorch."""
POSITIONS_LIMIT = 256
"""Positions a quorum's keys may be split into: a worker group's ranks, one process group per
rank position (rank r of every group averages with the others' rank r). It bounds, with the
keys per position, what one quorum holds on the server."""
OPS = ("set", "get", "add", "compare_set", "wait", "delete", "count")
"""The ops, each a route ``<Rendezvous.path>/<op>``."""


def _b64_ok(value: str) -> bool:
    if len(value) > B64_LIMIT:  # before decoding anything
        return False
    try:
        # The padding makes a few bytes more encode to as many characters: count them.
        return len(base64.b64decode(value, validate=True)) <= VALUE_LIMIT
    except (binascii.Error, ValueError):
        return False


KEY = text(KEY_LIMIT)
VALUE = Rule(f"standard base64 of at most {VALUE_LIMIT} bytes", _b64_ok)
QUORUM = Rule(f"a quorum id ({QUORUM_ID.pattern})", lambda v: bool(QUORUM_ID.fullmatch(v)))
WAIT = Rule(f"a number in [0, {WAIT_LIMIT:g}]", lambda v: 0 <= v <= WAIT_LIMIT)
KEYS = Rule(
    f"a list of 1 to {WAIT_KEYS_LIMIT} non-empty keys of at most {KEY_LIMIT} characters",
    lambda v: 0 < len(v) <= WAIT_KEYS_LIMIT and all(0 < len(k) <= KEY_LIMIT for k in v),
)
POSITION = Rule(f"an integer in [0, {POSITIONS_LIMIT})", lambda v: 0 <= v < POSITIONS_LIMIT)
AMOUNT = Rule(f"an integer in [-{COUNT_LIMIT}, {COUNT_LIMIT}]", lambda v: abs(v) <= COUNT_LIMIT)


def encode(value: bytes) -> str:
    """A value as it travels."""
    return base64.b64encode(value).decode("ascii")


def decode(value: str) -> bytes:
    """A value read (already checked by its message's rule)."""
    return base64.b64decode(value, validate=True)


@dataclass(frozen=True)
class StoreCall(Request):
    """What every call names: the caller, a member of ``quorum_id``."""

    worker_id: str = spec(rule=text())
    """The registered worker making the call."""
    quorum_id: str = spec(rule=QUORUM)
    """The quorum whose keys it reads or writes (``Assignment.quorum_id``)."""
    _: KW_ONLY
    """What follows is keyword-only: optional, it comes before the ops' required fields."""
    position: int = spec(default=0, rule=POSITION, omit=True)
    """The rank position whose keys it touches: each is a key space of its own (0: a whole
    worker's, or a group's rank 0)."""


@dataclass(frozen=True)
class StoreSet(StoreCall):
    """``set``: ``key`` holds ``value`` now. Answered by ``StoreDone``."""

    key: str = spec(rule=KEY)
    """The key."""
    value: str = spec(rule=VALUE)
    """Its value, base64."""


@dataclass(frozen=True)
class StoreGet(StoreCall):
    """``get``: ``key``'s value, waiting up to ``wait`` seconds for it to be set. Answered by
    ``StoreValue`` (``found`` false when the wait ended first)."""

    key: str = spec(rule=KEY)
    """The key."""
    wait: float = spec(default=0.0, rule=WAIT)
    """Seconds to wait for it (0: answer now)."""


@dataclass(frozen=True)
class StoreAdd(StoreCall):
    """``add``: a counter at ``key`` (0 when absent) grows by ``amount``. Answered by
    ``StoreNumber`` (the new count)."""

    key: str = spec(rule=KEY)
    """The counter's key."""
    amount: int = spec(rule=AMOUNT)
    """Added to it."""


@dataclass(frozen=True)
class StoreCompareSet(StoreCall):
    """``compare_set``: ``key`` takes ``desired`` if it holds ``expected`` (or is absent and
    ``expected`` is empty). Answered by ``StoreValue``: the value it holds after the call (or
    ``expected``, when absent and left so), as ``torch.distributed.Store`` answers."""

    key: str = spec(rule=KEY)
    """The key."""
    expected: str = spec(rule=VALUE)
    """The value it must hold, base64 (empty: absent)."""
    desired: str = spec(rule=VALUE)
    """The value it takes then, base64."""


@dataclass(frozen=True)
class StoreWait(StoreCall):
    """``wait``: until every one of ``keys`` is set, at most ``wait`` seconds (0: a check).
    Answered by ``StoreReady``."""

    keys: tuple[str, ...] = spec(rule=KEYS)
    """The keys."""
    wait: float = spec(default=0.0, rule=WAIT)
    """Seconds to wait for them (0: a check)."""


@dataclass(frozen=True)
class StoreDelete(StoreCall):
    """``delete``: ``key`` removed. Answered by ``StoreDeleted``."""

    key: str = spec(rule=KEY)
    """The key."""


@dataclass(frozen=True)
class StoreCount(StoreCall):
    """``count``: how many keys the quorum holds at ``position``. Answered by ``StoreNumber``."""


@dataclass(frozen=True, kw_only=True)
class StoreDone(Reply):
    """The reply to ``StoreSet``."""

    status: str = "ok"
    """Always ``ok``."""


@dataclass(frozen=True, kw_only=True)
class StoreValue(Reply):
    """A key's value (``StoreGet``, ``StoreCompareSet``)."""

    found: bool
    """The key was set (a get whose wait ran out: false)."""
    value: str = ""
    """Its value, base64 (empty when not found)."""


@dataclass(frozen=True, kw_only=True)
class StoreNumber(Reply):
    """A number (``StoreAdd``'s new count, ``StoreCount``'s keys)."""

    value: int
    """The number."""


@dataclass(frozen=True, kw_only=True)
class StoreReady(Reply):
    """The reply to ``StoreWait``."""

    ready: bool
    """Every key named was set within the wait."""


@dataclass(frozen=True, kw_only=True)
class StoreDeleted(Reply):
    """The reply to ``StoreDelete``."""

    deleted: bool
    """The key existed."""
