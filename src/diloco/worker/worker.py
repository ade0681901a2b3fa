"""DiLoCoWorker: wraps any training loop through an optimizer post-step hook.

Memory: besides the model, the worker keeps one fp32 snapshot of the global parameters, laid
out exactly like the server's download body so new parameters are read straight into it.
Pseudo-gradients are computed tensor by tensor as they are sent; no second model copy exists.

Failure handling follows one rule: local progress ``local - snapshot`` is never thrown away
while the server may not hold it. An accepted upload is held by the server only in memory until
its round closes, so its progress stays in the model until a round that holds it has arrived;
if that round does not come, the upload is handed in again under the same submission id (the
server answers "duplicate" if it still holds it) or, after a re-join that says the server lost
it, kept on top of the new parameters (a rebase). Steps dropped because the server already
holds the progress they are mixed with are counted (``dropped_steps``) and logged.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco.core import adopt_, pseudo_gradient_pieces, rebase_, to_progress_
from diloco.wire import Layout, TensorSpec, WireError, byte_view, check_against, tensor_views
from diloco.worker.adoption import StreamedAdoption
from diloco.worker.client import Conflict, DiLoCoClient, ServerError, UnknownWorker, Unreachable
from diloco.worker.settings import WorkerSettings, resolve
from diloco.worker.streaming import FragmentStreamer

log = logging.getLogger(__name__)

PIECE = 1 << 20  # elements of a pseudo-gradient computed at a time (4 MB of fp32 scratch)


class DiLoCoWorker:
    """Join a DiLoCo run from any training loop.

    >>> with DiLoCoWorker(model, optimizer, "10.0.0.5:8512", sync_every=500) as w:  # doctest: +SKIP
    ...     for batch in data:
    ...         loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...         w.report(loss=loss.item(), samples=len(batch))

    Arguments left as None come from ``DILOCO_*`` environment variables, then defaults
    (see ``WorkerSettings``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        server_addr: str | None = None,
        sync_every: int | None = None,
        bf16_comm: bool | None = None,
        worker_id: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        heartbeat_interval: float | None = None,
        retries: int | None = None,
        read_timeout: float | None = None,
        connect_timeout: float | None = None,
        max_barrier_wait: float | None = None,
        num_fragments: int | None = None,
        fragment_pattern: str | None = None,
        overlap_steps: int | None = None,
        merge_alpha: float | None = None,
        dylu: bool | None = None,
        client: DiLoCoClient | None = None,
    ) -> None:
        self.settings: WorkerSettings = resolve(
            {
                "server_addr": server_addr,
                "sync_every": sync_every,
                "bf16_comm": bf16_comm,
                "worker_id": worker_id,
                "token": token,
                "tls_ca": tls_ca,
                "heartbeat_interval": heartbeat_interval,
                "retries": retries,
                "read_timeout": read_timeout,
                "connect_timeout": connect_timeout,
                "max_barrier_wait": max_barrier_wait,
                "num_fragments": num_fragments,
                "fragment_pattern": fragment_pattern,
                "overlap_steps": overlap_steps,
                "merge_alpha": merge_alpha,
                "dylu": dylu,
            }
        )
        self.model = model
        self.optimizer = optimizer
        self.sync_every = self.settings.sync_every
        self.worker_id: str | None = self.settings.worker_id
        self.client = client or DiLoCoClient(
            self.settings.server_addr,
            token=self.settings.token,
            tls_ca=self.settings.tls_ca,
            connect_timeout=self.settings.connect_timeout,
            read_timeout=self.settings.read_timeout,
            retries=self.settings.retries,
        )
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        if not self._params:
            raise ValueError("the model has no parameters to synchronise")
        if not callable(getattr(optimizer, "register_step_post_hook", None)):
            raise ValueError(
                f"{type(optimizer).__name__} has no register_step_post_hook: the worker needs a "
                "torch.optim.Optimizer (or one that forwards that method) to see each step"
            )
        self._comm_dtype = "BF16" if self.settings.bf16_comm else "F32"
        self._device = next(iter(self._params.values())).device
        self._snapshot_payload: torch.Tensor | None = None
        self._snapshot: dict[str, torch.Tensor] = {}
        self._snapshot_layout: Layout | None = None
        self.base_round = 0
        self.instance = ""
        self.local_step = 0
        self.total_steps = 0
        self._samples = 0.0
        self._last_submission: str | None = None
        # An upload sent whose answer never came (every retry failed): the server may have
        # counted it. It is sent again under the same id, so the server can say so.
        self._unresolved: str | None = None
        self._hook: Any = None
        self._registered = False  # this worker's own registration succeeded at least once
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._need_rejoin = threading.Event()
        self._loss: float | None = None
        self._speed_mark = (time.monotonic(), 0, 0.0)  # time, total steps, stall seconds
        self._started = False
        self._last_step_at = time.monotonic()  # read by the heartbeat thread: is the loop alive?
        self._syncing = False
        # The model's values are not parameters until a refresh ends: they are its progress
        # (local - snapshot), or, when that progress was counted by the server (its upload was
        # accepted), values that will be replaced whole and must never be added back.
        self._holds_progress = False
        self._progress_counted = False
        self._as_progress = False  # the model holds local - snapshot (to_progress_ was applied)
        self._upload_steps = 0  # local steps in the last upload (counted if it is ever lost)
        # Rounds whose result this worker adopted after its upload counted in them, with that
        # upload's local steps: if the server later says it refused one (its result would not
        # have been finite, so it discarded every upload in it), those steps are counted dropped.
        self._adopted_uploads: dict[int, int] = {}
        self._scratch32: torch.Tensor | None = None
        self._scratch_comm: torch.Tensor | None = None
        self._snapshot_dirty = False  # a download broke off inside the snapshot's payload
        self._adopted = False  # the last download was adopted into the model as it landed
        self._last_metadata: dict[str, str] = {}  # of the last full download
        self.metrics: dict[str, float] = {
            "rounds": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "sync_time_s": 0.0,
            "stall_time_s": 0.0,
            "barrier_wait_s": 0.0,
            "retries": 0,
            "reconnections": 0,
            "rebases": 0,
            "failed_syncs": 0,
            "refused_submissions": 0,
            "sync_every": self.sync_every,
            "peak_sync_bytes_up": 0,
            "peak_sync_bytes_down": 0,
            "fragments_sent": 0,
            "stalls": 0,
            "dropped_steps": 0,
        }
        self._streaming = FragmentStreamer(self) if self.settings.num_fragments > 1 else None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> DiLoCoWorker:
        """Hook the optimizer, register, and load the global parameters into the model. If any
        of it fails (Ctrl-C too), the worker leaves the run before the error is raised: a worker
        registered but never joined would hold every round until the server dropped it."""
        if self._started:
            raise RuntimeError("worker already started")
        self._syncing = True  # the heartbeats start once registered: the loop is not hung
        try:
            # Hooked first: an optimizer that refuses the hook fails before registering.
            self._hook = self.optimizer.register_step_post_hook(self._post_step)
            self._join(initial=True)
        except BaseException:
            self._abandon_start()
            raise
        finally:
            self._syncing = False
        self._started = True
        self._last_step_at = time.monotonic()
        return self

    def _start_heartbeats(self) -> None:
        if self.settings.heartbeat_interval > 0 and self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name="diloco-heartbeat", daemon=True
            )
            self._hb_thread.start()

    def _unhook(self) -> None:
        """Stop seeing the optimizer's steps and stop the heartbeats."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)

    def _abandon_start(self) -> None:
        """Undo a failed start: unhook, stop the heartbeats, leave the run (best effort, within
        the client's timeouts), close the client."""
        self._unhook()
        try:
            if self._registered:
                self._leave_quietly()
        finally:
            self.client.close()

    def stop(self, *, submit: bool = True) -> None:
        """Send the remaining local steps (when ``submit``), then leave the run."""
        if not self._started:
            return
        self._started = False
        self._unhook()
        assert self.worker_id is not None
        try:
            if self._streaming is not None:
                self._streaming.finish(submit=submit)
            elif submit and self.local_step > 0:
                self._final_submit()
            self.client.deregister(self.worker_id)
        except (Unreachable, ServerError) as exc:
            log.warning("worker %s: could not leave cleanly: %s", self.worker_id, exc)
        finally:
            self.client.close()

    def __enter__(self) -> DiLoCoWorker:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # After a crash in the training loop the local state may be garbage: do not send it.
        self.stop(submit=exc_type is None)

    # --- what the training loop calls -----------------------------------------------------------

    def report(self, *, loss: float | None = None, samples: float | None = None) -> None:
        """Tell the worker the latest loss (shown by the server) and the samples or tokens just
        trained on (the weight of the next submission when the server weights by samples)."""
        if loss is not None:
            self._loss = float(loss)
        if samples is not None:
            if samples < 0:
                raise ValueError("samples must be >= 0")
            self._samples += samples

    def force_sync(self) -> None:
        """Sync now, whatever the step count (for example before an evaluation or a checkpoint).
        Streaming: every fragment in turn, each merged before the next is sent."""
        if self._streaming is not None:
            self._streaming.sync_all()
        else:
            self._sync()

    @property
    def sync_metrics(self) -> dict[str, float]:
        out = dict(self.metrics)
        out["retries"] = self.client.retry_count
        out["bytes_up"] = self.client.bytes_up
        out["bytes_down"] = self.client.bytes_down
        out["local_step"] = self.local_step
        out["total_steps"] = self.total_steps
        out["round"] = self.base_round
        if self._streaming is not None and self._streaming.rounds:
            out["round"] = min(self._streaming.rounds)  # the fragment furthest behind
        return out

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.local_step += 1
        self.total_steps += 1
        self._last_step_at = time.monotonic()
        if self._streaming is not None:
            self._streaming.after_step()
            return
        if self.local_step >= self.sync_every or self._need_rejoin.is_set():
            self._sync()

    # --- snapshot -------------------------------------------------------------------------------

    def _own_table(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self._params.items()}

    def _into_snapshot(self, layout: Layout) -> memoryview:
        """Check a download's layout against the model, then hand out the snapshot's memory."""
        check_against(layout, self._own_table(), ("F32",))
        if (
            self._snapshot_layout is None
            or self._snapshot_layout.offsets != layout.offsets
            or self._snapshot_layout.specs != layout.specs
        ):
            payload = torch.empty(layout.payload_size, dtype=torch.uint8)
            if self._device.type == "cuda":
                payload = payload.pin_memory()  # lets the copies to the GPU run asynchronously
            self._snapshot_payload = payload
            self._snapshot = tensor_views(layout, payload)
            self._snapshot_layout = layout
        self._snapshot_dirty = True
        assert self._snapshot_payload is not None
        return byte_view(self._snapshot_payload)

    def _download(
        self, min_round: int, deadline: float | None = None, *, adopt: bool = False
    ) -> bool:
        """Long-poll until the global parameters of ``min_round`` or later are in the snapshot.
        False if ``deadline`` passes first. With ``adopt``, the model takes each parameter's new
        values as its bytes land (``self._adopted`` says whether all of them did)."""
        t0 = time.monotonic()
        adoption: StreamedAdoption | None = None

        def into(layout: Layout) -> memoryview:
            nonlocal adoption
            view = self._into_snapshot(layout)
            if adopt:  # every body (a retry too) starts a fresh adoption from its first byte
                adoption = StreamedAdoption(layout, self._snapshot, self._param_data())
            return view

        def progress(received: int) -> None:
            if adoption is not None:
                adoption.upto(received)

        self._adopted = False
        try:
            while True:
                got = self.client.download(
                    into,
                    min_round=min_round,
                    worker_id=self.worker_id,
                    on_progress=progress if adopt else None,
                )
                if got is not None:
                    self._adopted = adoption is not None and adoption.complete
                    self.base_round = got.round
                    self.instance = got.instance
                    self._last_metadata = dict(got.layout.metadata)
                    self._snapshot_dirty = False
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
        finally:
            self.metrics["barrier_wait_s"] += time.monotonic() - t0

    def _each_param(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                fn(p.data, self._snapshot[name])
        self._settle_copies()

    def _settle_copies(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _param_data(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self._params.items()}

    # --- joining --------------------------------------------------------------------------------

    def _join(self, *, initial: bool) -> None:
        """Register (again), seed the server's parameters if it has none, and fetch them.

        On a re-join the model holds its local progress (``to_progress_`` was applied, or is
        applied here if it is to be kept); it is added back unless the server says its last
        upload is already in the parameters it serves."""
        try:
            reply = self._register(initial)
        except Conflict as exc:
            if exc.code == "fragments_mismatch":
                raise ValueError(
                    f"the server fragments the model differently: {exc.detail} "
                    "(set num_fragments and fragment_pattern as the server has them)"
                ) from exc
            raise
        self.worker_id = reply["worker_id"]
        self._registered = True
        if initial:
            # From here the server counts on this worker: heartbeats say it is alive however
            # long the first download of a big model takes.
            self._start_heartbeats()
        self._adopt_recommendation(reply)
        if reply.get("params") is not None:
            self._check_server_table(reply["params"])
        if self._streaming is not None:
            self._streaming.configure(reply)
        seeded = False
        if not reply.get("has_params"):
            try:
                seeded_reply = self.client.upload_initial(
                    self.worker_id, {n: p.detach() for n, p in self._params.items()}
                )
                seeded = True
                log.info("worker %s provided the initial parameters", self.worker_id)
                if self._streaming is not None:
                    self._streaming.configure(seeded_reply)
            except Conflict:
                pass  # another worker was first
        if initial:
            self._download(0)
            if self._streaming is not None:
                self._streaming.after_download(self._last_metadata)
            self._each_param(adopt_)
            log.info("worker %s joined at round %d", self.worker_id, self.base_round)
            return
        # Only an upload whose result we never adopted can be inside the model's progress.
        # A server restarted with no state may have taken our own parameters as its initial ones:
        # then the progress is in them already.
        last = reply.get("last_submission") or {}
        in_params = bool(last.get("in_params"))
        # Counted in a round still open: the server holds it in memory only. The progress stays
        # here and the upload goes again under the same id: "duplicate" while the server holds
        # it, counted afresh if a crash took it.
        held_open = last.get("counted_in") is not None and not in_params
        resend = self._last_submission if held_open and not seeded else None
        if self._holds_progress and self._progress_counted and not (seeded or in_params or resend):
            # A download broke off inside the model, then the server lost the round: the
            # progress it overwrote is gone. Only a server without --save-every 1 does that.
            self.metrics["dropped_steps"] += self._upload_steps
            log.error(
                "worker %s: the server lost an upload (%d local steps) whose result this worker "
                "had begun to adopt; those steps are dropped",
                self.worker_id,
                self._upload_steps,
            )
        if self._streaming is not None:
            if in_params:
                self._streaming.drop_counted_upload()  # only that fragment's progress is in them
            elif resend is not None:
                self._streaming.resend_counted_upload()
            in_params, resend = False, None
        counted = seeded or in_params
        self._refresh(counted=counted, min_round=0)
        if self._streaming is not None:
            self._streaming.after_download(self._last_metadata)
        self._last_submission = self._unresolved = resend
        self.metrics["reconnections"] += 1
        log.info(
            "worker %s re-joined at round %d (last upload %s)",
            self.worker_id,
            self.base_round,
            "counted"
            if counted
            else "held by the server, sent again at the next sync"
            if resend
            else "kept locally",
        )

    def _leave_quietly(self) -> None:
        """Deregister after a failed start, so the server does not wait for this worker.
        Best effort: the error that made it leave is the one to raise."""
        assert self.worker_id is not None
        try:
            self.client.deregister(self.worker_id)
        except (Unreachable, ServerError) as exc:
            log.warning("worker %s: could not deregister: %s", self.worker_id, exc)

    def _register(self, initial: bool) -> dict[str, Any]:
        return self.client.register(
            self.worker_id,
            hostname=socket.gethostname(),
            info={
                "pid": os.getpid(),
                "device": str(self._device),
                "sync_every": self.settings.sync_every,
                "num_fragments": self.settings.num_fragments,
                "fragment_pattern": self.settings.fragment_pattern,
            },
            last_submission_id=None if initial else self._last_submission,
        )

    def _check_server_table(self, entries: list[Any]) -> None:
        server = {str(n): tuple(int(d) for d in shape) for n, shape in entries}
        own = self._own_table()
        if server != own:
            missing = sorted(set(own) - set(server))[:3]
            extra = sorted(set(server) - set(own))[:3]
            shapes = [n for n in own if n in server and own[n] != server[n]][:3]
            raise ValueError(
                "the model does not match the server's parameters: "
                f"not on server {missing}, not in model {extra}, different shapes {shapes}"
            )

    # --- syncing --------------------------------------------------------------------------------

    def _specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, self._comm_dtype, tuple(p.shape)) for n, p in self._params.items()]

    def _produce(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        if self._scratch32 is None:  # small buffers reused for every tensor and every sync
            self._scratch32 = torch.empty(PIECE, dtype=torch.float32)
            self._scratch_comm = torch.empty(PIECE, dtype=torch.bfloat16)
        comm = self._scratch_comm if spec.dtype == "BF16" else None
        return pseudo_gradient_pieces(
            self._snapshot[spec.name], self._params[spec.name].data, self._scratch32, comm
        )

    def _submit(self, submission_id: str) -> dict[str, Any]:
        assert self.worker_id is not None
        self._upload_steps = self.local_step
        weight = self._samples if self._samples > 0 else float(self.local_step)
        return self.client.submit_pseudogradients(
            self.worker_id,
            self.base_round,
            submission_id,
            self._specs(),
            self._produce,
            weight=weight,
        )

    def _refresh(self, *, counted: bool, min_round: int, deadline: float | None = None) -> bool:
        """Fetch global parameters of ``min_round`` or later. If ``counted``, the local progress is
        in them and is dropped; otherwise it is kept on top of them (a rebase).

        False (or a network error) with the snapshot intact leaves the model with its local
        values, counted progress included: the round that holds it never arrived, and the server
        may have lost it with a crash. The caller hands that upload in again."""
        if self._holds_progress and self._progress_counted:
            counted = True  # a download broke off inside the model: only adoption is left
        if not counted and not self._as_progress:
            self._each_param(to_progress_)
            self._as_progress = True
        # Counted: the model is overwritten by the adoption, so it need not become progress
        # first (a pass over the model fewer per round). The server sends no byte of a round
        # before it is durable (with --save-every 1), so a download that breaks off inside the
        # model leaves progress the server holds.
        self._holds_progress = True
        self._progress_counted = counted
        try:
            if not self._download(min_round, deadline, adopt=counted):
                self._back_to_local()  # gave up waiting; the old snapshot is intact
                return False
        except (Unreachable, ServerError, WireError):
            if not self._snapshot_dirty:
                self._back_to_local()
            raise
        if counted and self._adopted:
            self._settle_copies()  # adopted as the bytes landed
        else:
            self._each_param(adopt_ if counted else rebase_)
        self._holds_progress = self._as_progress = False
        if not counted:
            self.metrics["rebases"] += 1
        return True

    def _back_to_local(self) -> None:
        """The snapshot is intact: the model takes back its local values, progress on top of
        the snapshot, counted or not (only a round that holds it may replace counted progress)."""
        if self._as_progress:
            self._each_param(rebase_)
            self._as_progress = False
        self._holds_progress = False

    def _sync(self) -> None:
        """Submit, wait for the round, adopt its result. Never raises a network error: failures
        are retried, logged, counted, and training goes on locally until the next sync."""
        t0 = time.monotonic()
        up, down = self.client.bytes_up, self.client.bytes_down
        self._syncing = True
        try:
            self._sync_once()
        except (Unreachable, ServerError, WireError) as exc:
            self.metrics["failed_syncs"] += 1
            log.warning("worker %s: sync failed, training on locally: %s", self.worker_id, exc)
            if self._holds_progress:
                self._recover_snapshot()
        finally:
            elapsed = time.monotonic() - t0
            self.metrics["sync_time_s"] += elapsed
            self.metrics["stall_time_s"] += elapsed
            self.local_step = 0
            self._syncing = False
            self._last_step_at = time.monotonic()
            sent, got = self.client.bytes_up - up, self.client.bytes_down - down
            self.metrics["peak_sync_bytes_up"] = max(self.metrics["peak_sync_bytes_up"], sent)
            self.metrics["peak_sync_bytes_down"] = max(self.metrics["peak_sync_bytes_down"], got)

    def _recover_snapshot(self) -> None:
        """A download broke off mid-payload after every retry: the model holds progress and the
        snapshot is partly overwritten. Nothing is trainable until a full download succeeds."""
        while True:
            try:
                self._refresh(counted=self._progress_counted, min_round=0)
                return
            except UnknownWorker:
                try:  # the server restarted or evicted us: register again, then download
                    self._join(initial=False)
                    return
                except (Unreachable, ServerError, WireError) as exc:
                    log.error("worker %s: re-join failed: %s", self.worker_id, exc)
            except (Unreachable, ServerError, WireError) as exc:
                log.error(
                    "worker %s: waiting for the server to rebuild the snapshot: %s",
                    self.worker_id,
                    exc,
                )

    def _sync_once(self) -> None:
        if self._need_rejoin.is_set():
            self._need_rejoin.clear()
            self._rejoin()
            return
        resent = self._unresolved is not None
        submission_id = self._unresolved or uuid.uuid4().hex
        # From the first byte sent the server may count this upload: until it answers, a re-join
        # asks about it, and a failed sync sends the next upload under the same id.
        self._unresolved = self._last_submission = submission_id
        try:
            reply = self._submit(submission_id)
        except UnknownWorker:
            self._rejoin()  # the server says there whether it holds the upload
            return
        except Conflict as exc:
            if exc.code != "upload_in_progress":  # that one may still be counted
                self._unresolved = self._last_submission = None  # answered: not counted
            self.metrics["refused_submissions"] += 1
            action = exc.body.get("action")
            log.info("worker %s: submission refused (%s): %s", self.worker_id, exc.code, exc.detail)
            if action == "rebase":
                self._refresh(counted=False, min_round=int(exc.body.get("round", 0)))
            return  # "continue": keep training on the same snapshot; "wait"/"retry": next sync
        self._unresolved = None
        self._count_refused(reply.get("refused_rounds"))
        if reply.get("refused"):  # async: this very update was refused (not finite)
            self.metrics["dropped_steps"] += self._upload_steps
            log.warning(
                "worker %s: the server refused the update of this upload (%s); its %d local "
                "steps are dropped",
                self.worker_id,
                reply["refused"],
                self._upload_steps,
            )
        if resent and reply.get("status") == "duplicate":
            # The lost answer was "accepted": those steps are the server's. The steps taken since
            # are mixed into the same local values and cannot be told apart, so they are dropped
            # with them rather than counted a second time.
            self.metrics["dropped_steps"] += self.local_step
            log.warning(
                "worker %s: an upload whose answer was lost had been counted in round %s; "
                "the %d local steps taken since are dropped",
                self.worker_id,
                reply.get("round"),
                self.local_step,
            )
        self._samples = 0.0
        counted_round = int(reply["round"])
        deadline = time.monotonic() + self.settings.max_barrier_wait
        try:
            adopted = self._refresh(counted=True, min_round=counted_round + 1, deadline=deadline)
        except UnknownWorker:
            self._rejoin()  # it asks whether the server still holds the upload
            return
        except (Unreachable, ServerError, WireError):
            if not self._holds_progress:  # the progress is still here: hand it in again
                self._unresolved = submission_id
            raise
        if adopted:
            self._last_submission = None
            self.metrics["rounds"] += 1
            self._adopted_uploads[counted_round] = self._upload_steps
            if len(self._adopted_uploads) > 16:  # the server names its last few refusals only
                del self._adopted_uploads[min(self._adopted_uploads)]
        else:
            self._unresolved = submission_id
            log.warning(
                "worker %s: round %d did not close within %.0f s; its upload stays in the model "
                "and goes again under the same id at the next sync",
                self.worker_id,
                counted_round,
                self.settings.max_barrier_wait,
            )

    def _rejoin(self) -> None:
        self._join(initial=False)

    def _count_refused(self, rounds: object) -> None:
        """The server refused these rounds (a result that would not be finite) and discarded
        every upload in them, ours too where we took part: those steps are dropped."""
        if not isinstance(rounds, list):
            return
        for r in rounds:
            steps = self._adopted_uploads.pop(r, None) if isinstance(r, int) else None
            if steps is not None:
                self.metrics["dropped_steps"] += steps
                log.warning(
                    "worker %s: the server refused round %d (its result would not have been "
                    "finite) and discarded its uploads; this worker's %d local steps in it are "
                    "dropped",
                    self.worker_id,
                    r,
                    steps,
                )

    def _final_submit(self) -> None:
        """On exit: hand in the last local steps without waiting for the round to close."""
        resent = self._unresolved is not None
        try:
            reply = self._submit(self._unresolved or uuid.uuid4().hex)
        except (Conflict, UnknownWorker) as exc:
            log.warning("worker %s: final submission not counted: %s", self.worker_id, exc.detail)
            return
        if resent and reply.get("status") == "duplicate":  # the earlier upload was held
            self.metrics["dropped_steps"] += self.local_step
            log.warning(
                "worker %s: its last upload had been counted; the %d local steps since are "
                "dropped",
                self.worker_id,
                self.local_step,
            )

    # --- heartbeats -------------------------------------------------------------------------------

    def _steps_per_second(self) -> float | None:
        now = time.monotonic()
        t, steps, stall = self._speed_mark
        stall_now = self.metrics["stall_time_s"]
        busy = (now - t) - (stall_now - stall)
        self._speed_mark = (now, self.total_steps, stall_now)
        if busy <= 0 or self.total_steps == steps:
            return None
        return (self.total_steps - steps) / busy

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.settings.heartbeat_interval):
            assert self.worker_id is not None
            try:
                reply = self.client.heartbeat(
                    self.worker_id,
                    steps_per_second=self._steps_per_second(),
                    loss=self._loss,
                    step_age_s=time.monotonic() - self._last_step_at,
                    syncing=self._syncing,
                )
                self._adopt_recommendation(reply)
            except UnknownWorker:
                self._need_rejoin.set()  # the training thread re-joins at its next step
            except (Unreachable, ServerError) as exc:
                log.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)

    def _adopt_recommendation(self, reply: dict[str, Any]) -> None:
        """DyLU: with ``dylu`` on, take the server's recommended ``sync_every`` (slower workers
        take fewer local steps, so all hand in work at about the same rate). The training thread
        reads it at its next step; an int assignment needs no lock."""
        value = reply.get("recommended_sync_every")
        if not self.settings.dylu or isinstance(value, bool) or not isinstance(value, int):
            return
        value = max(value, self.settings.num_fragments, 1)
        if value != self.sync_every:
            log.info(
                "worker %s: sync_every %d -> %d (DyLU)", self.worker_id, self.sync_every, value
            )
            self.sync_every = value
            self.metrics["sync_every"] = value
