"""The stage's side of a ``StageService``, on its ONE compute thread: the call tables, the
stage's arithmetic and its stepping (``StageCalls``), apart from the HTTP edge
(``stage_service.py``).

Every call is idempotent per call id: a retry gets the first reply and runs nothing again, so a
gradient is accumulated at most once per replica. The stage's optimizer steps (then zeroes the
gradients) once the backwards applied since its last step carry ``samples_per_step`` samples,
before the reply of the call that completed them, or with ``defer_steps`` (stage sync: a step
may hold a quorum round) right after that reply, ahead of every later call (``step_gate.py``).
While it steps, calls are answered 503 ``syncing``. At most ``max_calls`` held forwards (the
oldest dropped: its backward then gets 404) and finished replies, each for ``call_ttl_s`` at
most. Autograd and the optimizer see one call at a time, and the call tables need no lock; a
refused call changes nothing (every check comes before the first autograd operation).

Several drivers may feed one replica: their micro-batches' samples add up in one count, so the
replica steps on a mix of them (as Node0's do), and a step may fall between one driver's forward
and its backward. Each held forward keeps the parameter version it ran at (``StepGate.version``);
a backward whose forward is older runs that forward again from its kept input at the current
parameters first (``recomputes`` in the stats), then backs it up: the gradient is taken at the
parameters of the backward's time, against the output gradient the driver computed from the
first output (Node0 and SWARM do the same). Without it autograd refuses the backward (a saved
tensor was modified in place), or, for changes made through ``.data``, silently mixes two
versions. One driver never sees a recompute: a replica steps only once the driver's step is in.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diloco.swarm.boundary import BoundaryCodec, Meter
from diloco.swarm.step_gate import StepGate

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Hook = Callable[[str, str], None]
"""``hook(kind, call_id)``: called on the compute thread before a call's work; tests block in it
(a frozen replica) or wait for the Nth call (a replica killed at an exact moment)."""


@dataclass(frozen=True)
class StageEdges:
    """The codecs a stage's calls use. ``incoming`` is the boundary before the stage (``None``
    for the head, which is never served), ``outgoing`` the one after it (``None`` for the tail);
    each is a ``(forward, backward)`` pair of codecs."""

    incoming: tuple[BoundaryCodec, BoundaryCodec]
    outgoing: tuple[BoundaryCodec, BoundaryCodec] | None
    token_dims: int = 1
    """Leading dimensions that count as tokens (2 for ``[batch, seq, hidden]``)."""


class Refused(Exception):
    """A call refused with ``status`` and a machine-readable ``code``; nothing changed."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail
        self.counted = False  # in the stats already (refused on the compute thread)


@dataclass
class _Held:
    inp: torch.Tensor
    out: torch.Tensor
    reply: bytes
    samples: int
    at: float
    version: int  # ``StepGate.version`` when the forward ran


class StageCalls:
    """One stage, its optimizer and its call tables, run on one compute thread (``_pool``)."""

    def __init__(
        self,
        stage: nn.Module,
        optimizer: torch.optim.Optimizer,
        edges: StageEdges,
        *,
        samples_per_step: int,
        loss_fn: LossFn | None,
        max_calls: int,
        call_ttl_s: float,
        hook: Hook | None,
        before_step: Callable[[int], None] | None,
        defer_steps: bool,
        clock: Callable[[], float],
    ) -> None:
        if (edges.outgoing is None) != (loss_fn is not None):
            raise ValueError("the tail stage (no outgoing boundary) and only it takes a loss_fn")
        if samples_per_step < 1 or max_calls < 1 or call_ttl_s <= 0:
            raise ValueError("samples_per_step, max_calls and call_ttl_s must be positive")
        self.stage, self.optimizer, self.edges = stage, optimizer, edges
        self.samples_per_step, self.loss_fn = samples_per_step, loss_fn
        self.max_calls, self.call_ttl_s = max_calls, call_ttl_s
        self.hook, self.clock = hook, clock
        #: When the optimizer steps; ``before_step(samples)`` runs just before each step.
        self.gate = StepGate(optimizer, before_step, clock)
        self.defer_steps = defer_steps
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._done: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._samples = 0
        self._lock = threading.Lock()  # guards the counters below, read by stats()
        self._counts: dict[str, int] = {
            "steps": 0, "retries": 0, "dropped": 0, "refused": 0, "busy": 0, "recomputes": 0
        }  # fmt: skip
        self._meter = Meter(edges.token_dims)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every call handed to the compute thread so far, and the step it made
        due, has finished."""
        self._pool.submit(self.gate.run_due).result(timeout)

    def step_idle(self, timeout: float = 600.0) -> None:
        """One step with no gradient on the compute thread (``StepGate.idle_step``): a replica
        no driver calls still counts inner steps and so reaches its stage's rounds. Skipped
        while a step is under way here (samples applied, or forwards held): its gradients
        must not be cleared, and its driver's next call comes."""

        def idle() -> None:
            if self._samples == 0 and not self._held:
                self.gate.idle_step()

        self._pool.submit(idle).result(timeout)

    # --- the work (compute thread) -------------------------------------------------------------

    def _work(self, kind: str, query: dict[str, Any], body: bytes, arrived: float) -> bytes:
        # Counted here, on the compute thread: once ``drain`` returns, a refusal is in the
        # stats (the handler's reply may still be on its way).
        try:
            return self._call(kind, query, body, arrived)
        except Refused as exc:
            with self._lock:
                self._counts["refused"] += 1
            exc.counted = True
            raise

    def _call(self, kind: str, query: dict[str, Any], body: bytes, arrived: float) -> bytes:
        if self.gate.run_due():
            # This call overtook the step it follows; the step ran first, and its caller,
            # who waited through it, retries (its work must not be delayed past its budget).
            raise busy_refusal()
        if self.hook is not None:
            self.hook(kind, query["call"])
        budget = query.get("budget")
        if budget is not None and self.clock() - arrived > budget:
            # The caller has given up on this call (and re-sent it elsewhere): applying it
            # now would count its gradient on a replica the caller no longer uses.
            raise Refused(503, "late", f"the call waited past its budget of {budget} s")
        self._expire()
        call = query["call"]
        if call in self._done:
            if kind == "forward":
                raise Refused(409, "call_done", f"call {call} already went backward here")
            with self._lock:
                self._counts["retries"] += 1
            return self._done[call][0]
        if kind == "forward":
            return self._forward(call, query["samples"], body)
        if kind == "backward":
            return self._backward(call, body)
        return self._loss(call, query["samples"], query["scale"], body)

    def _decode(
        self, codec: BoundaryCodec, direction: str, body: bytes, extras: tuple[str, ...] = ()
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:
            t, got = codec.decode(body, extras)
        except ValueError as exc:
            raise Refused(400, "bad_boundary", str(exc)) from None
        self._meter.count(codec, direction, len(body), t.shape)
        return t, got

    def _forward(self, call: str, samples: int, body: bytes) -> bytes:
        held = self._held.get(call)
        if held is not None:
            with self._lock:
                self._counts["retries"] += 1
            return held.reply
        assert self.edges.outgoing is not None, "the tail is served by loss, not forward"
        x, _ = self._decode(self.edges.incoming[0], "in:forward", body)
        _check_samples(x, samples)
        x.requires_grad_(True)
        with torch.enable_grad():
            out = self.stage(x)
        reply = self._meter.encode(self.edges.outgoing[0], "out:forward", out)
        self._held[call] = _Held(x, out, reply, samples, self.clock(), self.gate.version)
        while len(self._held) > self.max_calls:
            self._held.popitem(last=False)
            with self._lock:
                self._counts["dropped"] += 1
        return reply

    def _backward(self, call: str, body: bytes) -> bytes:
        held = self._held.get(call)
        if held is None:
            raise Refused(404, "unknown_call", f"this replica holds no forward of call {call}")
        assert self.edges.outgoing is not None
        g, _ = self._decode(self.edges.outgoing[1], "out:backward", body)
        if g.shape != held.out.shape:
            raise Refused(
                400,
                "bad_boundary",
                f"boundary {self.edges.outgoing[1].spec.name}: expected gradient shape "
                f"{list(held.out.shape)}, got {list(g.shape)}",
            )
        if held.version != self.gate.version:
            held = self._recompute(held)
        torch.autograd.backward(held.out, g)
        assert held.inp.grad is not None
        reply = self._meter.encode(self.edges.incoming[1], "in:backward", held.inp.grad)
        del self._held[call]
        self._finish(call, reply, held.samples)
        return reply

    def _recompute(self, held: _Held) -> _Held:
        """``held``'s forward again at the current parameters, from a fresh leaf of its kept
        input (the first graph, never backed up, is dropped with its saved tensors)."""
        x = held.inp.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self.stage(x)
        with self._lock:
            self._counts["recomputes"] += 1
        return _Held(x, out, held.reply, held.samples, held.at, self.gate.version)

    def _loss(self, call: str, samples: int, scale: float, body: bytes) -> bytes:
        assert self.loss_fn is not None
        x, extras = self._decode(self.edges.incoming[0], "in:forward", body, ("targets",))
        _check_samples(x, samples)
        targets = extras["targets"]
        if targets.dim() < 1 or targets.shape[0] != x.shape[0]:
            raise Refused(
                400, "bad_targets", f"targets of shape {list(targets.shape)} for {samples} samples"
            )
        x.requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss_fn(self.stage(x), targets)
            if scale != 1.0:  # x * 1.0 is exact, but skipping it keeps the graph the reference's
                loss = loss * scale
            loss.backward()
        assert x.grad is not None
        reply = self._meter.encode(
            self.edges.incoming[1], "in:backward", x.grad, {"loss": loss.detach().float()}
        )
        self._finish(call, reply, samples)
        return reply

    def _finish(self, call: str, reply: bytes, samples: int) -> None:
        self._done[call] = (reply, self.clock())
        while len(self._done) > self.max_calls:
            self._done.popitem(last=False)
        self._samples += samples
        if self._samples >= self.samples_per_step:
            if self._samples > self.samples_per_step:
                log.warning(
                    "stage step over %d samples, not %d", self._samples, self.samples_per_step
                )
            self.gate.mark_due(self._samples)
            self._samples = 0
            with self._lock:
                self._counts["steps"] += 1
            if not self.defer_steps:
                self.gate.run_due()
                return
            try:  # after this reply is sent, ahead of any call handed over from now on
                self._pool.submit(self.gate.run_due)
            except RuntimeError:  # shut down (stopping): the step is dropped with the service
                pass

    def _expire(self) -> None:
        # Both tables are in arrival order: the expired calls are a prefix.
        old = self.clock() - self.call_ttl_s
        while self._held and next(iter(self._held.values())).at < old:
            self._held.popitem(last=False)
        while self._done and next(iter(self._done.values()))[1] < old:
            self._done.popitem(last=False)

    # --- observation ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Steps taken (idle ones apart), retries answered from the tables, calls dropped for
        room, refusals, calls answered 503 ``syncing`` (``busy``), held forwards run again
        because a step came between them and their backward (``recomputes``), idle steps, the
        forwards held now, and bytes and tokens per ``boundary:direction`` (``traffic``:
        received and sent; ``sent``: the replies only)."""
        with self._lock:
            return {
                **self._counts,
                "idle_steps": self.gate.idle_steps,
                "held": len(self._held),
                "pending_samples": self._samples,
                **self._meter.snapshot(),
            }


def busy_refusal() -> Refused:
    return Refused(503, "syncing", "the stage is stepping (a stage sync may be running): retry")


def _check_samples(x: torch.Tensor, samples: int) -> None:
    if x.shape[0] != samples:
        raise Refused(
            400, "bad_samples", f"the body holds {x.shape[0]} samples, the query says {samples}"
        )
