"""What every mode of combining the workers' pseudo-gradients promises the rest of the server.

A unit (the whole model, or one fragment) holds exactly one ``Aggregator``. The coordinator and the
intake talk to it only through this protocol, so a new mode (a new outer rule, a codec that
decodes compressed uploads before they count) is one new class here, not a branch elsewhere.
``SyncAggregator`` (server/rounds/sync_aggregator.py) closes a round when its expected workers have
submitted; ``AsyncAggregator`` (server/rounds/async_aggregator.py) applies each submission as it
lands.

The state machines behind them (server/rounds/barrier.py, server/rounds/async_gate.py) stay free of
tensors and I/O; an aggregator adds the running sum, the outer step and its publication.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from diloco.core.accumulate import Entry
from diloco.server.observe.records import State
from diloco.wire.messages import UploadReceipt


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"  # this submission id was already counted
    STALE = "stale_round"  # computed against an older round
    FUTURE = "future_round"  # names a round the server has not reached
    NOT_EXPECTED = "not_expected"  # joined after this round opened
    ALREADY_SUBMITTED = "already_submitted"  # a different submission from the same worker
    IN_PROGRESS = "upload_in_progress"  # the same worker is uploading right now
    CLOSING = "round_closing"  # the round is full and its outer step is running
    TOO_STALE = "too_stale"  # async: more updates than max_staleness since the worker's base


@dataclass(frozen=True)
class Check:
    """The decision on a submission before any of its payload is read (one type for every
    mode). ``round`` is the round (sync) or version (async) submissions must name now."""

    verdict: Verdict
    round: int
    counted_in: int | None = None  # for DUPLICATE: the round/version it went into
    staleness: int = 0  # async: updates applied since its base; sync quorum: rounds late


@dataclass
class Landed:
    """A submission whose whole body has landed and passed its checks (finite, its worker still
    registered and current): from here on it counts.

    ``tensors`` are in the unit's order, each a received tensor or an encoded one
    (``core.codecs.Encoded``: ``WeightedSum.add`` decodes it a chunk at a time); empty when
    ``written`` (the first write already put the body into the running sum). ``add`` runs a blocking addition on the tensor lock behind any
    first write, freeing the receive buffer as it reads; ``sum_add(w)`` is the addition of this
    body times ``w`` (its weight, or that scaled for lateness: the aggregator decides) to the
    unit's running sum in the order of its bytes (so the buffer refills behind it)."""

    worker_id: str
    submission_id: str
    base: int
    weight: float
    nbytes: int
    tensors: list[Entry]
    written: bool = False
    add: Callable[[Callable[[], None]], Awaitable[None]] | None = None
    sum_add: Callable[[float], Callable[[], None]] | None = None


class Aggregator(Protocol):
    """One unit's way of turning submissions into outer updates."""

    @property
    def round(self) -> int:
        """The round (sync) or version (async) a submission must name now."""
        ...

    @property
    def history(self) -> Mapping[str, int]:
        """Receipts: submission id -> the round/version it was counted in (bounded, oldest
        first). Checkpoints save them; a re-registering worker asks about its last one."""
        ...

    @property
    def versioned(self) -> bool:
        """Does every accepted submission make its own version (async), which replies name?"""
        ...

    def restore_receipt(self, submission_id: str, counted_in: int) -> None:
        """Put back a receipt read from a checkpoint."""
        ...

    def check(self, worker_id: str, base: int, submission_id: str) -> Check:
        """Decide on a submission before any byte of its payload is read. Pure: changes
        nothing, so a refused request leaves no trace."""
        ...

    def begin_upload(self, worker_id: str, submission_id: str) -> None:
        """An accepted submission starts arriving (``check`` said ACCEPT just before)."""
        ...

    def abort_upload(self, worker_id: str, submission_id: str) -> None:
        """The upload failed before it counted: forget it (no-op if superseded)."""
        ...

    def is_current(self, worker_id: str, submission_id: str) -> bool:
        """Is this still the upload in flight for its worker (it did not leave and come back
        meanwhile)?"""
        ...

    def first_write(self) -> bool:
        """May an upload now be written into the running sum as it arrives (nothing else of
        the round matters yet)? The intake adds its own conditions."""
        ...

    def reads_late(self) -> bool:
        """Does ``accept`` read the body before it returns (async: the update is applied from
        the receive buffer), rather than queueing an add behind the next upload?"""
        ...

    async def accept(self, landed: Landed) -> UploadReceipt:
        """Count a landed submission with its weight: add it to the round, or apply it. Returns
        the receipt's mode-specific fields (``status``, ``round``, and for async ``version``,
        ``staleness``, ``weight``, ``refused``; the caller adds the rest). Raises ``ApiError`` 409 when it can no longer
        count (async: too stale by now)."""
        ...

    def ready(self) -> bool:
        """May the current round close now? (Always False where updates apply on arrival.)"""
        ...

    def begin_close(self) -> int:
        """Mark the ready round closing and return it; ``close`` then applies it."""
        ...

    async def close(self, round_: int) -> None:
        """Apply the closing round: outer step, publication, run log. A refused (non-finite)
        round still ends, published with the parameters unchanged."""
        ...

    def on_join(self, live: set[str]) -> None:
        """A worker registered; ``live`` is every registered worker now."""
        ...

    def on_leave(self, worker_id: str) -> None:
        """A worker left (deregistered, evicted, kicked). Its counted submission stays."""
        ...

    def open_with(self, live: set[str]) -> bool | None:
        """Open a waiting round with the workers here (a resumed run whose others did not come
        back). True if it opened, False if it still waits, None if nothing waits to open."""
        ...

    def set_num_workers(self, num_workers: int, live: set[str]) -> None:
        """An operator changed how many workers the run expects."""
        ...

    def public(self) -> State:
        """The public state for status."""
        ...
