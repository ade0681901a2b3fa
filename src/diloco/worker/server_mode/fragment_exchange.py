"""The streaming worker's background thread: one fragment's trip to the server at a time.

The training thread fills a fragment's send buffer and hands an ``Exchange`` to the sender; the
sender uploads the buffer, long-polls the fragment's new global values into the receive buffer
and sets ``done``. The training thread reads the outcome only after that, so an ``Exchange`` is
never touched by both threads at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from diloco.core.fragments import Piece
from diloco.wire import Layout, WireError, byte_view, check_against, tensor_views
from diloco.wire.messages import UploadReceipt
from diloco.worker.session import Session
from diloco.worker.transport.client import SYNC_FAILURES, Conflict, UnknownWorker

log = logging.getLogger(__name__)


@dataclass
class Exchange:
    """One fragment's trip to the server: written by the sender thread until ``done`` is set,
    read by the training thread after."""

    fragment: int
    base_round: int
    submission_id: str
    weight: float
    tokens: float | None  # counted since the fragment was last sent; None: the loop counts none
    apply_at: int  # the total step count after which the result is merged
    pieces: list[Piece] = field(default_factory=list)
    send: dict[str, torch.Tensor] = field(default_factory=dict)  # the pseudo-gradient, per piece
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "pending"  # merge | rebase | keep | failed | timeout | rejoin
    counted: bool = False  # the server holds this pseudo-gradient
    unanswered: bool = False  # the upload got no answer: the server may hold it or not
    resent: bool = False  # sent under the id of an earlier upload the server may hold
    duplicate: bool = False  # ... and the server answered that it holds it
    gated: bool = False  # async: acknowledged past the age gate, nothing of it applied
    steps: int = 0  # local steps of the fragment since it was last sent
    new_round: int = 0
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    detail: str = ""
    bytes_up: int = 0
    bytes_down: int = 0


class FragmentSender:
    """Carries ``Exchange``s on one daemon thread, in the order they are handed in."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.recv: torch.Tensor | None = None  # receive buffer: the largest fragment in fp32
        self.abandon = threading.Event()  # the worker is leaving: stop long-polling
        self._queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None

    def send(self, job: Exchange) -> None:
        """Start ``job`` (the previous one must be done)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._sender, name="diloco-fragments", daemon=True
            )
            self._thread.start()
        self._queue.put(job)

    def close(self) -> None:
        """Stop the thread after the exchange in flight (waits up to the read timeout)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self._s.settings.read_timeout)

    def _sender(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._exchange(job)
            except Exception as exc:  # a bug must not leave the training loop waiting forever
                log.exception("worker %s: fragment exchange crashed", self._s.worker_id)
                job.outcome, job.detail = "failed", repr(exc)
            finally:
                job.done.set()

    def _exchange(self, job: Exchange) -> None:
        s, k = self._s, job.fragment
        assert s.worker_id is not None
        body = s.encoder.fragment_upload(job.pieces, job.send)
        before = s.client.bytes_up
        try:
            reply = s.client.submit_pseudogradients(
                s.worker_id,
                job.base_round,
                job.submission_id,
                body.specs,
                body.produce,
                weight=job.weight,
                tokens=job.tokens,
                fragment=k,
                loss=s.loss,
                steps=s.total_steps,
                codec=s.encoder.metadata,
            )
            receipt = UploadReceipt.from_json(reply)  # one that does not read: unanswered
        except UnknownWorker:
            job.outcome = "rejoin"
            return
        except Conflict as exc:
            job.detail = f"refused ({exc.code}): {exc.detail}"
            if exc.reply.action == "rebase":
                self._download(job, exc.reply.round or 0, "rebase")
            else:  # continue / wait / retry: the progress stays local until the next period
                job.outcome = "keep"
            return
        except SYNC_FAILURES as exc:
            job.outcome, job.detail = "failed", str(exc)
            job.unanswered = True
            return
        finally:
            job.bytes_up = s.client.bytes_up - before
        job.counted = True
        job.duplicate = job.resent and receipt.status == "duplicate"
        job.gated = receipt.gated
        if not job.duplicate:  # this body counted: the residual moves (worker/state/encoder.py)
            body.commit()
        # Sync: wait for the fragment's round to close. Async: the reply names the new version.
        self._download(job, receipt.result_round, "merge")

    def _download(self, job: Exchange, min_round: int, outcome: str) -> None:
        s, k = self._s, job.fragment
        assert self.recv is not None
        table = {p.wire_name: (p.numel,) for p in job.pieces}
        recv = self.recv

        def into(layout: Layout) -> memoryview:
            check_against(layout, table, ("F32",))
            return byte_view(recv)[: layout.payload_size]

        before = s.client.bytes_down
        deadline = time.monotonic() + s.settings.max_barrier_wait
        try:
            while True:
                got = s.client.download(
                    into, min_round=min_round, worker_id=s.worker_id, fragment=k
                )
                if got is not None:
                    if got.layout.metadata.get("fragment") != str(k):
                        raise WireError("bad_metadata", f"asked for fragment {k}, got another")
                    job.received = tensor_views(got.layout, recv)
                    job.new_round = got.round
                    job.outcome = outcome
                    return
                if time.monotonic() > deadline or self.abandon.is_set():
                    job.outcome = "timeout"
                    job.detail = f"round {min_round} did not come"
                    return
        except UnknownWorker:
            job.outcome = "rejoin"
        except SYNC_FAILURES as exc:
            job.outcome, job.detail = "failed", str(exc)
        finally:
            job.bytes_down = s.client.bytes_down - before
