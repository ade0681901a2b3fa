"""The run's record: recent outer updates, staleness, refusals, traffic counters, and the upload
waits of each open round. Written by the aggregators and the intake, read by status.

Nothing here decides anything; it only remembers, so status and metrics have one place to read.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from diloco.server.members.rates import Rate
from diloco.server.observe.records import Refusal, UpdateEntry

log = logging.getLogger(__name__)

REFUSED_TOLD = 8  # refused rounds named in upload replies (a worker syncs at least once between)
UPDATE_LOG = 2048  # outer updates remembered for status and metrics
# A round whose longest upload wait for a receive buffer passes both of these gets a hint in the
# log (once per run): the uploads then queue enough to matter.
HINT_WAIT_S = 1.0
HINT_WAIT_SHARE = 0.25


class RunLog:
    """What happened so far (owned here; the aggregators and the intake append)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started_at = clock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0
        #: Async uploads acknowledged but not applied: their staleness policy gave weight 0.
        self.gated = 0
        self.last_round_contributions = 0
        #: Rounds (sync) or updates (async) refused because their result would not be finite.
        self.refused_updates = 0
        self.last_refusal: Refusal | None = None
        #: Per unit, the latest refused rounds: told in upload replies, so a worker whose upload
        #: one of them discarded counts those steps as dropped.
        self.refused_rounds: dict[int, deque[int]] = {}
        #: Recent outer updates (sync: rounds; async: applied submissions), newest last.
        self.update_log: deque[UpdateEntry] = deque(maxlen=UPDATE_LOG)
        self.staleness_log: deque[int] = deque(maxlen=UPDATE_LOG)
        self.staleness_total = 0
        self.staleness_count = 0
        #: Per unit: seconds each upload toward its open round waited for a receive buffer.
        self.upload_waits: dict[int, list[float]] = {}
        self._slots_hinted = False
        #: (upload slots, bytes each), told by the intake once it has sized its pool.
        self.slot_sizes = (0, 0)
        #: Per unit: bytes of the uploads counted since its last update; and bytes sent since
        #: the last update of any unit (downloads need not name a unit).
        self._round_in: dict[int, int] = {}
        self._round_out = 0
        #: Downloads sent whole: of parameters (the model or one fragment), and of a lossy
        #: downlink's update bodies (server/params/update_bodies.py).
        self.full_downloads = 0
        self.update_downloads = 0
        #: Uploads counted (with fragments: each fragment's), and the traffic's rate both ways.
        self.submissions = 0
        self.traffic = Rate()

    def received(self, unit: int, nbytes: int) -> None:
        """An upload of ``nbytes`` (header included) toward ``unit`` counted."""
        self.bytes_in += nbytes
        self._round_in[unit] = self._round_in.get(unit, 0) + nbytes
        self.submissions += 1
        self.traffic.add(self.clock(), self.bytes_in + self.bytes_out)

    def sent(self, nbytes: int, *, update: bool = False) -> None:
        """A download of ``nbytes`` was sent whole (``update``: a round's update body)."""
        self.bytes_out += nbytes
        self._round_out += nbytes
        self.traffic.add(self.clock(), self.bytes_in + self.bytes_out)
        if update:
            self.update_downloads += 1
        else:
            self.full_downloads += 1

    def waited(self, unit: int, seconds: float) -> None:
        """An upload toward ``unit``'s open round got its receive buffer after ``seconds``."""
        self.upload_waits.setdefault(unit, []).append(seconds)

    def staleness(self, stale: int) -> None:
        self.staleness_log.append(stale)
        self.staleness_total += stale
        self.staleness_count += 1

    def refuse(
        self, unit: int, round_: int, contributions: int, why: str, *, what: str, where: str
    ) -> None:
        """A round/update of ``unit`` was refused for a non-finite result."""
        self.refused_updates += 1
        self.refused_rounds.setdefault(unit, deque(maxlen=REFUSED_TOLD)).append(round_)
        self.last_refusal = Refusal(round_, unit, why)
        log.error(
            "%s %d%s refused: %s; its %d contribution(s) are discarded and the parameters and "
            "outer optimizer state stay as they were",
            what,
            round_,
            where,
            why,
            contributions,
        )

    def update(
        self,
        unit: int,
        round_: int,
        outer_s: float,
        contributions: int,
        nbytes: int | None,
        *,
        refused: bool,
        staleness: int | None = None,
        weight: float | None = None,
    ) -> UpdateEntry:
        """Record one outer update of ``unit``; its round's upload waits and bytes go with it.
        ``nbytes``: async, the one upload the update applies (counted by ``received`` only
        after this); sync: None, the uploads counted toward the unit since its last update."""
        now = self.clock()
        since = now - (self.update_log[-1].t if self.update_log else self.started_at)
        waits = self.upload_waits.pop(unit, [])
        # In sync mode no upload toward the next round can have counted yet: its workers need
        # this round's result first, published just before this record.
        counted = self._round_in.pop(unit, 0)
        round_in = counted if nbytes is None else nbytes
        round_out, self._round_out = self._round_out, 0
        entry = UpdateEntry(
            round=round_,
            fragment=unit,
            t=now,  # shown relative to the start in a status
            round_time_s=round(since, 4),
            outer_step_s=round(outer_s, 4),
            contributions=contributions,
            bytes_in=self.bytes_in + (nbytes or 0),
            staleness=staleness,
            weight=weight,
            refused=refused,
            upload_wait_s=round(sum(waits), 4),
            upload_wait_max_s=round(max(waits, default=0.0), 4),
            round_bytes_in=round_in,
            round_bytes_out=round_out,
        )
        self.update_log.append(entry)
        return entry

    def hint_upload_slots(self, entry: UpdateEntry) -> None:
        """Say once, when it first matters, that uploads queued for the receive buffers: with
        workers behind links slower than the server's, more slots let them arrive together."""
        longest, round_s = entry.upload_wait_max_s, entry.round_time_s
        if self._slots_hinted or longest < HINT_WAIT_S or longest < HINT_WAIT_SHARE * round_s:
            return
        self._slots_hinted = True
        slots, slot_bytes = self.slot_sizes
        log.warning(
            "round %d: an upload waited %.1f s of the round's %.1f s for one of the %d upload "
            "buffer(s) (upload_slots); if workers reach this server over links slower than its "
            "own, more slots let their uploads arrive together, at up to %.0f MB of memory each "
            "(half that with bf16 uploads): diloco server --upload-slots N",
            entry.round,
            longest,
            round_s,
            slots,
            slot_bytes / 1e6,
        )
