"""The all-reduce mode's rendezvous: a key/value store per quorum, in the server's memory,
where each round's quorum builds its process group (gloo's, or NCCL's, connection details).
A quorum's keys are split by rank position (``position``, 0 unless said): sharded worker groups
average shard with shard, rank r of every group in a process group of its own, and each such
group meets in its own key space, made at its first call. A group's non-zero ranks call with
their group's worker id (the member), so the membership rule is the quorum's, on every position.

It is served by the server's own HTTP API (``server/web/rendezvous_routes.py``, behind the
bearer token like every route) and no other port: a stranger without the token cannot read,
write, wait on or delete a key. Beyond the token, a call must name a worker that is a member of
the quorum whose keys it touches (``members_of``, the quorum book's knowledge: the open quorum,
or one that ended and is still remembered); others are refused (403 ``not_a_member``), an
unknown quorum is 404 ``unknown_quorum``, a quorum whose keys were dropped 410
``quorum_ended``. Tensors never pass through here: the members connect to one another.

Bounds, before anything is stored: keys and values by their messages
(``wire/messages/rendezvous.py``), positions per quorum (``POSITIONS_LIMIT``: 400
``bad_field``), keys per position (``KEYS_BASE`` + ``KEYS_PER_MEMBER`` per member: 413
``store_full``), quorums holding keys (``QUORUMS_KEPT``, counted in quorums, not positions: the
oldest quorum dropped first, with all its positions), and every wait by ``max_wait`` (the
collective timeout). Each quorum holds at most ``QUORUM_BYTES`` of keys and values over all its
positions (413 ``store_full``), so the store holds at most ``QUORUMS_KEPT`` x ``QUORUM_BYTES``
(128 MiB) whatever the members and positions. ``forget(quorum_id)`` drops a finished quorum's keys on every position (the
book calls it once no member can still be connecting).

Pure state with asyncio waits and an injected clock: no HTTP here. Used from the server's event
loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from diloco.server.errors import ApiError
from diloco.wire.messages.rendezvous import COUNT_LIMIT, POSITIONS_LIMIT

log = logging.getLogger(__name__)

KEYS_BASE = 16
KEYS_PER_MEMBER = 8
"""Keys a quorum may hold at one position: gloo sets one per member (its address), NCCL a few
more."""
QUORUM_BYTES = 2 << 20
"""Bytes (keys and values) one quorum holds on all its positions together: gloo and NCCL put a
few hundred bytes a rank there, so this is room for thousands of ranks; what bounds the store
whatever the group sizes (``QUORUMS_KEPT`` quorums of at most this many bytes)."""
QUORUMS_KEPT = 64
"""Quorums whose keys are held at once: a run that discards quorums without completing one
never forgets them (``QuorumBook``), so the oldest go past this many (long timed out)."""
FORGOTTEN_KEPT = 1024
"""Forgotten quorum ids remembered, to answer 410 rather than 404."""

MembersOf = Callable[[str], "tuple[str, ...] | None"]
"""A quorum's members by id; None for a quorum the server does not know (or no longer)."""


class _Keys:
    """One quorum's keys at one position, and an event set (then replaced) at every change, for
    the waits (a change at another position wakes none of them). ``quorum`` counts the bytes
    held on all of its positions."""

    def __init__(self, quorum: _Quorum) -> None:
        self.quorum = quorum
        self.limit = KEYS_BASE + KEYS_PER_MEMBER * len(quorum.members)
        self.values: dict[str, bytes] = {}
        self.changed = asyncio.Event()

    def changes(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def put(self, key: str, value: bytes) -> None:
        """``key`` holds ``value`` now, within this position's keys limit and the quorum's
        bytes (413 ``store_full`` before anything changes); the waits are woken."""
        held = self.values.get(key)
        if held is None and len(self.values) >= self.limit:
            raise ApiError(
                413,
                "store_full",
                f"a quorum of {len(self.quorum.members)} holds at most {self.limit} keys a position",
            )
        grows = len(value) - (len(held) if held is not None else -len(key.encode()))
        if self.quorum.bytes + grows > QUORUM_BYTES:
            raise ApiError(
                413, "store_full", f"a quorum's keys hold at most {QUORUM_BYTES} bytes in all"
            )
        self.quorum.bytes += grows
        self.values[key] = value
        self.changes()

    def pop(self, key: str) -> bool:
        held = self.values.pop(key, None)
        if held is None:
            return False
        self.quorum.bytes -= len(held) + len(key.encode())
        self.changes()
        return True


class _Quorum:
    """A quorum's members (as known at its first call) and its positions' keys."""

    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = frozenset(members)
        self.positions: dict[int, _Keys] = {}
        self.bytes = 0  # keys and values held on all positions

    def at(self, position: int) -> _Keys:
        keys = self.positions.get(position)
        if keys is None:
            keys = self.positions[position] = _Keys(self)
        return keys

    def changes(self) -> None:
        for keys in self.positions.values():
            keys.changes()

    def held(self) -> int:
        return sum(len(keys.values) for keys in self.positions.values())


class RendezvousStore:
    """The quorums' keys. ``members_of`` says who may touch a quorum's; ``max_wait`` (seconds)
    bounds every wait; ``clock`` measures them. Every op takes ``position`` (keyword, 0 unless
    said): the key space it touches within the quorum."""

    def __init__(
        self,
        members_of: MembersOf,
        *,
        max_wait: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_wait <= 0:
            raise ValueError(f"max_wait must be positive, got {max_wait}")
        self._members_of = members_of
        self.max_wait = max_wait
        self._clock = clock
        self._quorums: OrderedDict[str, _Quorum] = OrderedDict()
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.closed = False

    # --- the ops (each checks the caller first; none stores anything before its checks) --------

    def set(
        self, worker: str, quorum_id: str, key: str, value: bytes, *, position: int = 0
    ) -> None:
        self._keys(worker, quorum_id, position).put(key, value)

    async def get(
        self, worker: str, quorum_id: str, key: str, wait: float, *, position: int = 0
    ) -> bytes | None:
        """``key``'s value, once set within ``wait`` seconds (cut to ``max_wait``); else None."""
        ready = await self.wait(worker, quorum_id, (key,), wait, position=position)
        return self._keys(worker, quorum_id, position).values[key] if ready else None

    def add(self, worker: str, quorum_id: str, key: str, amount: int, *, position: int = 0) -> int:
        keys = self._keys(worker, quorum_id, position)
        held = keys.values.get(key, b"0")
        try:
            count = int(held.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise ApiError(409, "not_a_counter", f"key {key!r} holds no counter") from None
        if abs(count) > COUNT_LIMIT:
            raise ApiError(409, "counter_overflow", f"counter {key!r} would pass {COUNT_LIMIT}")
        keys.put(key, str(count).encode("ascii"))
        return count

    def compare_set(
        self,
        worker: str,
        quorum_id: str,
        key: str,
        expected: bytes,
        desired: bytes,
        *,
        position: int = 0,
    ) -> bytes:
        """``desired`` stored if ``key`` holds ``expected`` (absent counts as empty); the value
        held after the call, or ``expected`` for a key left absent."""
        keys = self._keys(worker, quorum_id, position)
        held = keys.values.get(key)
        if (held if held is not None else b"") != expected:
            return held if held is not None else expected
        keys.put(key, desired)
        return desired

    async def wait(
        self, worker: str, quorum_id: str, wanted: Iterable[str], wait: float, *, position: int = 0
    ) -> bool:
        """Every key of ``wanted`` set within ``wait`` seconds (cut to ``max_wait``; 0: a
        check). Access is checked again after every change: a quorum forgotten meanwhile
        ends the wait with its 410."""
        names = tuple(wanted)
        deadline = self._clock() + min(max(wait, 0.0), self.max_wait)
        while True:
            keys = self._keys(worker, quorum_id, position)
            if all(k in keys.values for k in names):
                return True
            left = deadline - self._clock()
            if left <= 0 or self.closed:
                return False
            changed = keys.changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                pass

    def delete(self, worker: str, quorum_id: str, key: str, *, position: int = 0) -> bool:
        return self._keys(worker, quorum_id, position).pop(key)

    def count(self, worker: str, quorum_id: str, *, position: int = 0) -> int:
        """Keys held at ``position``."""
        return len(self._keys(worker, quorum_id, position).values)

    # --- life -----------------------------------------------------------------------------------

    def forget(self, quorum_id: str) -> int:
        """Drop a quorum's keys, on every position, once its round is over (every member built
        its group, timed out or moved on); returns how many went. Later calls on it, at any
        position, are 410 ``quorum_ended``."""
        quorum = self._quorums.pop(quorum_id, None)
        self._forgotten[quorum_id] = None
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        if quorum is None:
            return 0
        quorum.changes()  # a member still waiting learns at once that the quorum is over
        return quorum.held()

    def close(self) -> None:
        """The server stops: every wait ends now, and the keys go. Idempotent."""
        self.closed = True
        for quorum in self._quorums.values():
            quorum.changes()
        self._quorums.clear()

    def held(self) -> dict[str, int]:
        """Keys held per quorum, summed over its positions (for tests and the log)."""
        return {qid: quorum.held() for qid, quorum in self._quorums.items()}

    def _keys(self, worker: str, quorum_id: str, position: int) -> _Keys:
        """The quorum's keys at ``position``, for a member of it; made at the first call there
        (the quorum's at its members' first call)."""
        if not 0 <= position < POSITIONS_LIMIT:  # the message's rule, for in-process callers
            raise ApiError(
                400, "bad_field", f"'position' must be an integer in [0, {POSITIONS_LIMIT})"
            )
        if self.closed:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        if quorum_id in self._forgotten:
            raise ApiError(
                410, "quorum_ended", f"quorum {quorum_id!r} is over; its keys were dropped"
            )
        members = self._members_of(quorum_id)
        if members is None:
            raise ApiError(404, "unknown_quorum", f"no quorum {quorum_id!r} on this server")
        quorum = self._quorums.get(quorum_id)
        if worker not in (quorum.members if quorum is not None else members):
            raise ApiError(
                403, "not_a_member", f"worker {worker!r} is not a member of quorum {quorum_id!r}"
            )
        if quorum is None:
            quorum = self._quorums[quorum_id] = _Quorum(members)
            while len(self._quorums) > QUORUMS_KEPT:
                oldest, _ = next(iter(self._quorums.items()))
                log.info(
                    "rendezvous: quorum %s's keys dropped (%d quorums held)", oldest, QUORUMS_KEPT
                )
                self.forget(oldest)
        return quorum.at(position)
