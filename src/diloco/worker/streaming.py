"""Streaming DiLoCo on the worker (arXiv 2501.18512): the model syncs one fragment at a time.

A fragment is a list of flat element ranges of parameters, planned by the server. Fragment ``f``
is due after inner step ``sync_offsets(H, P)[f]`` of every period of ``H`` steps. When it is due,
its pseudo-gradient ``snapshot - local`` is written into a send buffer (1/P of the model) and a
background thread uploads it and long-polls the fragment's new global values into a receive
buffer (1/P of the model, fp32), while the training loop goes on. ``tau`` steps after it was sent
the result is merged: ``local = alpha * local + (1 - alpha) * global``, ``snapshot = global``.

Only one exchange is in flight. A fragment that comes due while the previous one is still out
waits for it (a stall, counted). Fragments are disjoint, so a merge never touches the elements of
another fragment's pending pseudo-gradient.

The full snapshot keeps the layout of a full download, so joining and re-joining work exactly as
in plain DiLoCo (``DiLoCoWorker._join``); only the fragment rounds and plan are added here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diloco.core import merge_, pseudo_gradient_pieces, rebase_, to_progress_
from diloco.core.fragments import split_sequential, split_strided, sync_offsets
from diloco.wire import Layout, TensorSpec, WireError, byte_view, check_against, tensor_views
from diloco.worker.client import Conflict, ServerError, UnknownWorker, Unreachable

if TYPE_CHECKING:
    from diloco.worker.worker import DiLoCoWorker

log = logging.getLogger(__name__)

PIECE = 1 << 20  # elements of a pseudo-gradient computed at a time
NETWORK_FAILURES = (Unreachable, ServerError, WireError)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened parameter ``param``, sent as ``wire_name``."""

    wire_name: str
    param: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_from_server(
    entries: Sequence[Any], table: Mapping[str, tuple[int, ...]]
) -> list[list[Piece]]:
    """Check the server's plan (``[[wire_name, param, start, stop], ...]`` per fragment) against
    the model: every element of every parameter in exactly one piece."""
    if not isinstance(entries, list) or len(entries) < 2:
        raise ValueError(f"the server's fragment plan is not a list of 2 or more: {entries!r:.200}")
    sizes = {name: _numel(shape) for name, shape in table.items()}
    plan: list[list[Piece]] = []
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in table}
    for fragment in entries:
        if not isinstance(fragment, list) or not fragment:
            raise ValueError(
                f"a fragment of the server's plan is empty or not a list: {fragment!r:.200}"
            )
        pieces = []
        for entry in fragment:
            if not (isinstance(entry, list | tuple) and len(entry) == 4):
                raise ValueError(f"bad piece in the server's fragment plan: {entry!r:.200}")
            wire_name, param, start, stop = (
                str(entry[0]),
                str(entry[1]),
                int(entry[2]),
                int(entry[3]),
            )
            if param not in sizes or not 0 <= start < stop <= sizes[param]:
                raise ValueError(f"the server's fragment piece {entry!r} does not fit the model")
            pieces.append(Piece(wire_name, param, start, stop))
            covered[param].append((start, stop))
        plan.append(pieces)
    for name, spans in covered.items():
        spans.sort()
        pos = 0
        for start, stop in spans:
            if start != pos:
                raise ValueError(f"the server's fragments cover {name!r} with a gap or an overlap")
            pos = stop
        if pos != sizes[name]:
            raise ValueError(f"the server's fragments do not cover all of {name!r}")
    return plan


def plan_locally(
    table: Mapping[str, tuple[int, ...]], num_fragments: int, pattern: str
) -> list[list[Piece]]:
    """The plan the server makes from the same parameter order (used when it joined a server
    that had no parameters yet and another worker seeded them)."""
    split = split_sequential if pattern == "sequential" else split_strided
    spans = split([(name, _numel(shape)) for name, shape in table.items()], num_fragments)
    return [
        [Piece(f"{s.name}[{s.start}:{s.stop}]", s.name, s.start, s.stop) for s in fragment]
        for fragment in spans
    ]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Schedule:
    """Which fragment is due after each inner step: every fragment exactly once per period."""

    def __init__(self, sync_every: int, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self.phase = 0  # inner steps taken in the current period
        self.retime(sync_every)

    def retime(self, sync_every: int) -> None:
        """A new period length; takes effect at the start of a period (phase 0)."""
        assert self.phase == 0, "the schedule changes only between periods"
        self.sync_every = sync_every
        offsets = sync_offsets(sync_every, self.num_fragments)
        self._due = {step: f for f, step in enumerate(offsets)}

    def advance(self) -> int | None:
        """Count one inner step; the fragment due after it, or None."""
        self.phase += 1
        due = self._due.get(self.phase)
        if self.phase >= self.sync_every:
            self.phase = 0
        return due


@dataclass
class Exchange:
    """One fragment's trip to the server: written by the sender thread until ``done`` is set,
    read by the training thread after."""

    fragment: int
    base_round: int
    submission_id: str
    weight: float
    apply_at: int  # the total step count after which the result is merged
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "pending"  # merge | rebase | keep | failed | timeout | rejoin
    counted: bool = False  # the server holds this pseudo-gradient
    unanswered: bool = False  # the upload got no answer: the server may hold it or not
    resent: bool = False  # sent under the id of an earlier upload the server may hold
    duplicate: bool = False  # ... and the server answered that it holds it
    steps: int = 0  # local steps of the fragment since it was last sent
    new_round: int = 0
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    detail: str = ""
    bytes_up: int = 0
    bytes_down: int = 0


class FragmentStreamer:
    """The streaming half of a ``DiLoCoWorker`` with ``num_fragments > 1``."""

    def __init__(self, worker: DiLoCoWorker) -> None:
        self.w = worker
        settings = worker.settings
        self.alpha = settings.merge_alpha
        self.tau = settings.overlap_steps
        self.pattern = settings.fragment_pattern
        self.mode = "sync"
        self.plan: list[list[Piece]] = []
        self.rounds: list[int] = []
        self.schedule = Schedule(worker.sync_every, settings.num_fragments)
        self._sent_step: list[int] = []  # total step count when each fragment was last sent
        self._sent_samples: list[float] = []
        self._send_views: list[dict[str, torch.Tensor]] = []
        self._recv: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._inflight: Exchange | None = None
        self._uncounted_drop: Exchange | None = None  # counted upload whose result never came
        # Per fragment, an upload whose every answer was lost: the server may have counted it,
        # so the fragment's next upload goes under the same id (a duplicate if it had).
        self._unresolved: dict[int, str] = {}
        self._queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._abandon = threading.Event()

    # --- plan and rounds ----------------------------------------------------------------------

    def configure(self, reply: Mapping[str, Any]) -> None:
        """Take the mode, plan and fragment rounds from a register or initial-params reply."""
        if reply.get("mode"):
            self.mode = str(reply["mode"])
        if reply.get("fragments") is not None:
            self._set_plan(plan_from_server(reply["fragments"], self.w._own_table()))
        rounds = reply.get("fragment_rounds")
        if rounds is not None:
            self.rounds = [int(r) for r in rounds]

    def after_download(self, metadata: Mapping[str, str]) -> None:
        """A full download arrived in the snapshot: its metadata holds every fragment's round."""
        raw = metadata.get("fragment_rounds")
        if raw is None:
            raise ValueError(
                "the server runs plain DiLoCo (its parameters carry no fragment rounds); "
                f"use num_fragments=1 or start it for {self.w.settings.num_fragments} fragments"
            )
        if not self.plan:
            log.info("worker %s: planning fragments as the server does", self.w.worker_id)
            self._set_plan(
                plan_locally(self.w._own_table(), self.w.settings.num_fragments, self.pattern)
            )
        rounds = [int(r) for r in raw.split(",")]
        if len(rounds) != len(self.plan):
            raise ValueError(
                f"the server has {len(rounds)} fragment rounds for a plan of {len(self.plan)}"
            )
        self.rounds = rounds

    def _set_plan(self, plan: list[list[Piece]]) -> None:
        if plan == self.plan:
            return
        if self._inflight is not None:
            raise RuntimeError("the fragment plan changed while a fragment was in flight")
        if len(plan) != self.schedule.num_fragments:
            log.warning(
                "worker %s: the server plans %d fragments, this worker was set for %d",
                self.w.worker_id,
                len(plan),
                self.schedule.num_fragments,
            )
            if len(plan) > self.w.sync_every:
                raise ValueError(f"{len(plan)} fragments need sync_every >= {len(plan)}")
            self.schedule = Schedule(self.w.sync_every, len(plan))
        for name, param in self.w._params.items():
            if not param.data.is_contiguous():
                raise ValueError(f"streaming needs contiguous parameters; {name!r} is not")
        self.plan = plan
        comm = torch.bfloat16 if self.w._comm_dtype == "BF16" else torch.float32
        largest = max(sum(p.numel for p in frag) for frag in plan)
        send = torch.empty(largest, dtype=comm)
        self._send_views = []
        for frag in plan:
            views, offset = {}, 0
            for p in frag:
                views[p.wire_name] = send[offset : offset + p.numel]
                offset += p.numel
            self._send_views.append(views)
        self._recv = torch.empty(largest * 4, dtype=torch.uint8)
        self._sent_step = [self.w.total_steps] * len(plan)
        self._sent_samples = [self.w._samples] * len(plan)

    # --- the training thread ------------------------------------------------------------------

    def after_step(self) -> None:
        """Called by the optimizer hook after every inner step."""
        w = self.w
        t0 = time.monotonic()
        busy = False
        job = self._inflight
        if job is not None and w.total_steps >= job.apply_at:
            self._finish(job)
            busy = True
        due = self.schedule.advance()
        w.local_step = self.schedule.phase
        if due is not None:
            busy = True
            if w._need_rejoin.is_set():
                self._rejoin()
            else:
                self._send(due)
                if self.tau == 0:
                    assert self._inflight is not None
                    self._finish(self._inflight)
        if self.schedule.phase == 0:
            self._retime()
        if busy:
            w.metrics["sync_time_s"] += time.monotonic() - t0
            w._last_step_at = time.monotonic()

    def sync_all(self) -> None:
        """Send every fragment now and merge each result before the next (``force_sync``)."""
        if self.w._need_rejoin.is_set():
            self._rejoin()
            return
        for k in range(len(self.plan)):
            self._send(k)
            assert self._inflight is not None
            self._finish(self._inflight)

    def finish(self, *, submit: bool) -> None:
        """On exit: let the exchange in flight end (after its current poll), then hand in every
        fragment's steps since it was last sent, without waiting for its round."""
        self._abandon.set()
        if self._inflight is not None:
            self._finish(self._inflight)
        try:
            if submit and not self.w._need_rejoin.is_set():
                for k in range(len(self.plan)):
                    if self.w.total_steps > self._sent_step[k]:
                        self._final_submit(k)
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join(timeout=self.w.settings.read_timeout)

    def _retime(self) -> None:
        """Between periods: follow ``sync_every`` if DyLU changed it (the heartbeat thread sets
        it at any time; the schedule takes it only at a period boundary)."""
        sync_every = max(self.w.sync_every, len(self.plan))
        if sync_every != self.schedule.sync_every:
            self.schedule.retime(sync_every)

    def _slices(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        """The piece's elements in the model and in the snapshot (views, no copies)."""
        local = self.w._params[piece.param].data.view(-1)[piece.start : piece.stop]
        snapshot = self.w._snapshot[piece.param].view(-1)[piece.start : piece.stop]
        return local, snapshot

    def _fill(self, k: int) -> None:
        """Write fragment ``k``'s pseudo-gradient into the send buffer (rounded after the fp32
        subtraction)."""
        if self._scratch is None:
            self._scratch = torch.empty(PIECE, dtype=torch.float32)
        for piece in self.plan[k]:
            local, snapshot = self._slices(piece)
            out = self._send_views[k][piece.wire_name]
            offset = 0
            for chunk in pseudo_gradient_pieces(snapshot, local, self._scratch, None):
                out[offset : offset + chunk.numel()].copy_(chunk)
                offset += chunk.numel()

    def _send(self, k: int) -> None:
        w = self.w
        if self._inflight is not None:  # at most one exchange in flight
            self._finish(self._inflight)
        self._fill(k)
        steps = w.total_steps - self._sent_step[k]
        samples = w._samples - self._sent_samples[k]
        self._sent_step[k] = w.total_steps
        self._sent_samples[k] = w._samples
        resent = k in self._unresolved
        job = Exchange(
            fragment=k,
            base_round=self.rounds[k],
            submission_id=self._submission_id(k),
            weight=samples if samples > 0 else float(max(steps, 1)),
            apply_at=w.total_steps + self.tau,
            resent=resent,
            steps=steps,
        )
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._sender, name="diloco-fragments", daemon=True
            )
            self._thread.start()
        self._inflight = job
        self._queue.put(job)
        w.metrics["fragments_sent"] += 1

    def _finish(self, job: Exchange) -> None:
        """Wait for the exchange (a stall if it is not back yet), then apply its outcome."""
        w = self.w
        if not job.done.is_set():
            w.metrics["stalls"] += 1
            t0 = time.monotonic()
            w._syncing = True
            job.done.wait()
            w._syncing = False
            w.metrics["stall_time_s"] += time.monotonic() - t0
        self._inflight = None
        self._apply(job)

    def _apply(self, job: Exchange) -> None:
        w, k = self.w, job.fragment
        w.metrics["peak_sync_bytes_up"] = max(w.metrics["peak_sync_bytes_up"], job.bytes_up)
        w.metrics["peak_sync_bytes_down"] = max(w.metrics["peak_sync_bytes_down"], job.bytes_down)
        with torch.no_grad():
            if job.outcome == "merge":
                for piece in self.plan[k]:
                    local, snapshot = self._slices(piece)
                    merge_(local, snapshot, job.received[piece.wire_name], self.alpha)
                self.rounds[k] = job.new_round
                w.metrics["rounds"] += 1
            elif job.outcome == "rebase":  # keep the local progress on top of the new values
                for piece in self.plan[k]:
                    local, snapshot = self._slices(piece)
                    to_progress_(local, snapshot)
                    snapshot.copy_(job.received[piece.wire_name])
                    rebase_(local, snapshot)
                self.rounds[k] = job.new_round
                w.metrics["rebases"] += 1
                w.metrics["refused_submissions"] += 1
            elif job.outcome == "keep":
                w.metrics["refused_submissions"] += 1
            elif job.outcome in ("failed", "timeout"):
                w.metrics["failed_syncs"] += 1
                if job.unanswered or job.counted:
                    # Counted or maybe counted, but its round never came: the server may have
                    # lost it with a crash, so the progress stays in the model and the
                    # fragment's next upload goes under the same id ("duplicate" if it holds it).
                    self._unresolved[k] = job.submission_id
            elif job.outcome == "rejoin":
                w._need_rejoin.set()
                if job.counted:
                    self._uncounted_drop = job
                    w._last_submission = job.submission_id
            if w._device.type == "cuda":
                torch.cuda.synchronize(w._device)
        if job.outcome == "merge" and job.duplicate:
            # The server already held an earlier upload under this id: the fragment's steps
            # since then are mixed into the same values and are dropped with the merge.
            w.metrics["dropped_steps"] += job.steps
            log.warning(
                "worker %s: fragment %d's earlier upload had been counted; its %d local steps "
                "since are dropped",
                w.worker_id,
                k,
                job.steps,
            )
        if job.outcome != "merge":
            log.info("worker %s: fragment %d %s %s", w.worker_id, k, job.outcome, job.detail)

    def _drop_sent(self, k: int) -> None:
        """Remove the sent pseudo-gradient's progress from the model, keeping later steps:
        ``local + (snapshot - local_then)``."""
        for piece in self.plan[k]:
            local, _ = self._slices(piece)
            sent = self._send_views[k][piece.wire_name]
            local.add_(sent.to(local.device, local.dtype))

    def drop_counted_upload(self) -> None:
        """Re-join: the server says the upload whose result never came is in its parameters."""
        if self._uncounted_drop is not None:
            self._drop_sent(self._uncounted_drop.fragment)
            self._uncounted_drop = None

    def resend_counted_upload(self) -> None:
        """Re-join: the server holds the upload whose result never came in a round still open
        (in memory only). Its progress stays; the fragment's next upload goes under its id."""
        if self._uncounted_drop is not None:
            job = self._uncounted_drop
            self._unresolved[job.fragment] = job.submission_id
            self._uncounted_drop = None

    def _rejoin(self) -> None:
        w = self.w
        if self._inflight is not None:
            self._finish(self._inflight)
        w._need_rejoin.clear()
        try:
            w._join(initial=False)
        except NETWORK_FAILURES as exc:
            w.metrics["failed_syncs"] += 1
            w._need_rejoin.set()  # tried again when the next fragment is due
            log.warning("worker %s: re-join failed, training on locally: %s", w.worker_id, exc)
            if w._holds_progress:
                w._recover_snapshot()
        finally:
            self._uncounted_drop = None

    def _submission_id(self, k: int) -> str:
        """The id of fragment ``k``'s next upload: the unanswered one's again, if there is one."""
        return self._unresolved.pop(k, "") or uuid.uuid4().hex

    def _final_submit(self, k: int) -> None:
        w = self.w
        assert w.worker_id is not None
        self._fill(k)
        specs = [TensorSpec(p.wire_name, w._comm_dtype, (p.numel,)) for p in self.plan[k]]
        views = self._send_views[k]
        try:
            w.client.submit_pseudogradients(
                w.worker_id,
                self.rounds[k],
                self._submission_id(k),
                specs,
                lambda spec: views[spec.name],
                weight=float(w.total_steps - self._sent_step[k]),
                fragment=k,
            )
            w.metrics["fragments_sent"] += 1
        except (Conflict, UnknownWorker) as exc:
            log.warning(
                "worker %s: final submission of fragment %d not counted: %s",
                w.worker_id,
                k,
                exc.detail,
            )

    # --- the sender thread --------------------------------------------------------------------

    def _sender(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._exchange(job)
            except Exception as exc:  # a bug must not leave the training loop waiting forever
                log.exception("worker %s: fragment exchange crashed", self.w.worker_id)
                job.outcome, job.detail = "failed", repr(exc)
            finally:
                job.done.set()

    def _exchange(self, job: Exchange) -> None:
        w, k = self.w, job.fragment
        assert w.worker_id is not None
        specs = [TensorSpec(p.wire_name, w._comm_dtype, (p.numel,)) for p in self.plan[k]]
        views = self._send_views[k]
        before = w.client.bytes_up
        try:
            reply = w.client.submit_pseudogradients(
                w.worker_id,
                job.base_round,
                job.submission_id,
                specs,
                lambda spec: views[spec.name],
                weight=job.weight,
                fragment=k,
            )
        except UnknownWorker:
            job.outcome = "rejoin"
            return
        except Conflict as exc:
            job.detail = f"refused ({exc.code}): {exc.detail}"
            if exc.body.get("action") == "rebase":
                self._download(job, int(exc.body.get("round", 0)), "rebase")
            else:  # continue / wait / retry: the progress stays local until the next period
                job.outcome = "keep"
            return
        except NETWORK_FAILURES as exc:
            job.outcome, job.detail = "failed", str(exc)
            job.unanswered = True
            return
        finally:
            job.bytes_up = w.client.bytes_up - before
        job.counted = True
        job.duplicate = job.resent and reply.get("status") == "duplicate"
        counted_round = int(reply["round"])
        # Sync: wait for the fragment's round to close. Async: the reply names the new version.
        min_round = (
            int(reply.get("version", counted_round)) if self.mode == "async" else counted_round + 1
        )
        self._download(job, min_round, "merge")

    def _download(self, job: Exchange, min_round: int, outcome: str) -> None:
        w, k = self.w, job.fragment
        assert self._recv is not None
        table = {p.wire_name: (p.numel,) for p in self.plan[k]}
        recv = self._recv

        def into(layout: Layout) -> memoryview:
            check_against(layout, table, ("F32",))
            return byte_view(recv)[: layout.payload_size]

        before = w.client.bytes_down
        deadline = time.monotonic() + w.settings.max_barrier_wait
        try:
            while True:
                got = w.client.download(
                    into, min_round=min_round, worker_id=w.worker_id, fragment=k
                )
                if got is not None:
                    if got.layout.metadata.get("fragment") != str(k):
                        raise WireError("bad_metadata", f"asked for fragment {k}, got another")
                    job.received = tensor_views(got.layout, recv)
                    job.new_round = got.round
                    job.outcome = outcome
                    return
                if time.monotonic() > deadline or self._abandon.is_set():
                    job.outcome = "timeout"
                    job.detail = f"round {min_round} did not come"
                    return
        except UnknownWorker:
            job.outcome = "rejoin"
        except NETWORK_FAILURES as exc:
            job.outcome, job.detail = "failed", str(exc)
        finally:
            job.bytes_down = w.client.bytes_down - before
