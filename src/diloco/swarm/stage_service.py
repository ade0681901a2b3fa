"""StageService: one pipeline stage served over HTTP to the drivers of a swarm.

Routes (``POST``, bodies in the safetensors layout of ``swarm/boundary.py``):

- ``/swarm/stage/forward?call=ID&samples=N``: the input activations; runs the stage with autograd,
  keeps ``(input, output)`` under ``ID``, replies the output activations.
- ``/swarm/stage/backward?call=ID``: the gradient of that output; runs backward, replies the
  gradient of the input, frees the call. An ``ID`` this replica does not hold is a 404
  ``unknown_call``: the driver forwards here again (or elsewhere) from the input it kept.
- ``/swarm/stage/loss?call=ID&samples=N&scale=S`` (the tail only): activations and
  ``targets``; runs forward, ``scale * loss_fn(out, targets)`` and backward at once, replies
  that scaled loss (``"loss"``, 0-d) and the gradient of the input.

Every call is idempotent per ``ID``: a retry gets the first reply and runs nothing again, so a
gradient is accumulated at most once per replica. The stage's optimizer steps (then zeroes the
gradients) once the backwards applied since its last step carry ``samples_per_step`` samples,
before the reply of the call that completed them, or with ``defer_steps`` (stage sync: a step
may hold a quorum round) right after that reply, ahead of every later call
(``step_gate.py``). While it steps (with stage sync, a whole quorum round), calls are answered
503 ``syncing`` with ``retry_after`` seconds instead of waiting.

Bounds: at most ``max_calls`` held forwards (the oldest dropped; its backward then gets 404),
each for ``call_ttl_s`` at most; the same for finished replies; bodies up to
``max_body_bytes`` (413), read within ``body_timeout_s``; the token is checked from the headers
before a body byte is read. All stage arithmetic runs on ONE compute thread: autograd and the
optimizer see one call at a time, and the call tables need no lock. A refused call changes
nothing: every check happens before the first autograd operation.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from torch import nn

from diloco.edge.connections import ConnectionTable, LimitedSite, vouch
from diloco.swarm.boundary import BoundaryCodec, Traffic, tokens_of
from diloco.swarm.step_gate import StepGate

log = logging.getLogger(__name__)

PREFIX = "/swarm/stage/"
CALL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_SAMPLES = 1 << 20

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


class StageService:
    """Serves ``stage`` (with its ``optimizer``) to drivers. ``loss_fn`` is given to the tail
    (``edges.outgoing is None``) and to no other stage."""

    def __init__(
        self,
        stage: nn.Module,
        optimizer: torch.optim.Optimizer,
        edges: StageEdges,
        *,
        samples_per_step: int,
        token: str | None,
        loss_fn: LossFn | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_calls: int = 64,
        call_ttl_s: float = 120.0,
        max_body_bytes: int = 64 << 20,
        body_timeout_s: float = 30.0,
        header_timeout_s: float = 10.0,
        max_connections: int = 256,
        max_connections_per_address: int = 16,
        hook: Hook | None = None,
        before_step: Callable[[int], None] | None = None,
        defer_steps: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (edges.outgoing is None) != (loss_fn is not None):
            raise ValueError("the tail stage (no outgoing boundary) and only it takes a loss_fn")
        if samples_per_step < 1 or max_calls < 1 or call_ttl_s <= 0:
            raise ValueError("samples_per_step, max_calls and call_ttl_s must be positive")
        self.stage, self.optimizer, self.edges = stage, optimizer, edges
        self.samples_per_step, self.loss_fn = samples_per_step, loss_fn
        self.token, self.host, self._port = token, host, port
        self.max_calls, self.call_ttl_s = max_calls, call_ttl_s
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.header_timeout_s = header_timeout_s
        #: Connections bounded before the token is shown (``diloco.edge``, as the server's).
        self.connections = ConnectionTable(max_connections, max_connections_per_address)
        self.hook, self.clock = hook, clock
        #: When the optimizer steps; ``before_step(samples)`` runs just before each step.
        self.gate = StepGate(optimizer, before_step, clock)
        self.defer_steps = defer_steps
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._done: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._samples = 0
        self._lock = threading.Lock()  # guards the counters below, read by stats()
        self._counts: dict[str, int] = {
            "steps": 0, "retries": 0, "dropped": 0, "refused": 0, "busy": 0
        }  # fmt: skip
        self._traffic = Traffic()
        self._sent = Traffic()  # the replies this replica sent: what the coordinator sums
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self._port}"

    def start(self, timeout: float = 30.0) -> StageService:
        """Serve from a thread of its own; returns once the socket is bound."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._serve(ready))
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failed.append(exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="stage-service", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failed:
            raise RuntimeError(f"stage service did not start: {failed}")
        return self

    async def _serve(self, ready: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.gate.bind(self._loop)
        app = web.Application(client_max_size=self.max_body_bytes)
        for kind in ("forward", "backward", "loss"):
            app.router.add_post(PREFIX + kind, self._handler(kind))
        # keepalive_timeout: a connection still waiting for a complete request head this long
        # after it opened or its last reply is closed (the header deadline, edge/connections.py).
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=self.header_timeout_s
        )
        await self._runner.setup()
        site = LimitedSite(
            self._runner,
            self.host,
            self._port,
            self.connections,
            handshake_timeout=self.header_timeout_s,
        )
        await site.start()
        self._port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()
        await self._stop.wait()
        await self._runner.cleanup()

    def stop(self, *, abrupt: bool = False, timeout: float = 10.0) -> None:
        """Stop serving. ``abrupt`` resets every open connection first (a killed replica: a
        caller mid-call sees its connection reset, not a reply). The compute thread is not
        waited for: a call blocked in a hook finishes (unseen) when the hook returns."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or self._thread is None or loop.is_closed():
            return  # never started, or stopped already

        def halt() -> None:
            if abrupt and self._runner is not None and self._runner.server is not None:
                for conn in self._runner.server.connections:
                    conn.force_close()
                    if conn.transport is not None:
                        conn.transport.abort()
            stop.set()

        loop.call_soon_threadsafe(halt)
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

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

    # --- HTTP ----------------------------------------------------------------------------------

    def _handler(self, kind: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                self._authenticate(request)
                query = _query(request, kind)
                body = await asyncio.wait_for(request.read(), self.body_timeout_s)
                arrived = self.clock()
                reply = await self._compute(kind, query, body, arrived)
            except Refused as exc:
                if exc.code == "syncing":
                    with self._lock:
                        self._counts["busy"] += 1
                    return web.json_response(
                        {"error": exc.code, "detail": exc.detail,
                         "retry_after": self.gate.retry_after()},
                        status=503, headers={"Retry-After": "1"},
                    )  # fmt: skip
                if exc.status != 401 and not exc.counted:
                    with self._lock:
                        self._counts["refused"] += 1
                return web.json_response(
                    {"error": exc.code, "detail": exc.detail}, status=exc.status
                )
            except TimeoutError:
                return web.json_response(
                    {"error": "slow_body", "detail": "body not received in time"}, status=408
                )
            return web.Response(body=reply, content_type="application/octet-stream")

        return handle

    async def _compute(
        self, kind: str, query: dict[str, Any], body: bytes, arrived: float
    ) -> bytes:
        """The call on the compute thread, unless the stage steps first: a call that arrives
        while it steps, or is still queued when a step begins, is refused 503 ``syncing`` at
        once (its caller retries) rather than left waiting through a quorum round."""
        if self.gate.busy.is_set():
            raise _busy()
        job = self._pool.submit(self._work, kind, query, body, arrived)
        done: asyncio.Future[Any] = asyncio.wrap_future(job)
        busy: asyncio.Future[Any] = asyncio.ensure_future(self.gate.wait_busy())
        try:
            await asyncio.wait({done, busy}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            busy.cancel()
        if not done.done() and job.cancel():
            raise _busy()  # never started: nothing of it ran
        return await done  # running already (it may be the one that steps): its answer

    def _authenticate(self, request: web.Request) -> None:
        if self.token is None:  # an open service (tests): every caller is trusted
            vouch(request)
            return
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            raise Refused(401, "unauthorized", "missing or wrong bearer token")
        vouch(request)  # a token holder's connection no longer counts against strangers'

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
            raise _busy()
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
        self._count(codec, direction, len(body), t.shape)
        return t, got

    def _encode(
        self,
        codec: BoundaryCodec,
        direction: str,
        t: torch.Tensor,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> bytes:
        body = codec.encode(t, extras)
        self._count(codec, direction, len(body), t.shape, sent=True)
        return body

    def _count(
        self, codec: BoundaryCodec, direction: str, n: int, shape: Any, *, sent: bool = False
    ) -> None:
        tokens = tokens_of(tuple(shape), self.edges.token_dims)
        with self._lock:
            self._traffic.add(codec.spec.name, direction, n, tokens)
            if sent:
                self._sent.add(codec.spec.name, direction, n, tokens)

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
        reply = self._encode(self.edges.outgoing[0], "out:forward", out)
        self._held[call] = _Held(x, out, reply, samples, self.clock())
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
        torch.autograd.backward(held.out, g)
        assert held.inp.grad is not None
        reply = self._encode(self.edges.incoming[1], "in:backward", held.inp.grad)
        del self._held[call]
        self._finish(call, reply, held.samples)
        return reply

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
        reply = self._encode(
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
        room, refusals, calls answered 503 ``syncing`` (``busy``), idle steps, the forwards
        held now, and bytes and tokens per ``boundary:direction`` (``traffic``: received and
        sent; ``sent``: the replies only)."""
        with self._lock:
            return {
                **self._counts,
                "idle_steps": self.gate.idle_steps,
                "held": len(self._held),
                "pending_samples": self._samples,
                "traffic": self._traffic.snapshot(),
                "sent": self._sent.snapshot(),
            }


def _busy() -> Refused:
    return Refused(503, "syncing", "the stage is stepping (a stage sync may be running): retry")


def _check_samples(x: torch.Tensor, samples: int) -> None:
    if x.shape[0] != samples:
        raise Refused(
            400, "bad_samples", f"the body holds {x.shape[0]} samples, the query says {samples}"
        )


def _query(request: web.Request, kind: str) -> dict[str, Any]:
    q = request.query
    call = q.get("call", "")
    if not CALL_ID.match(call):
        raise Refused(400, "bad_call", "call must be 1-128 characters of [A-Za-z0-9._:-]")
    out: dict[str, Any] = {"call": call}
    try:
        if kind != "backward":
            out["samples"] = int(q.get("samples", ""))
            if not 1 <= out["samples"] <= MAX_SAMPLES:
                raise ValueError
        if kind == "loss":
            out["scale"] = float(q.get("scale", "1"))
            if not (math.isfinite(out["scale"]) and 0 < out["scale"] <= 1):
                raise ValueError
        if "budget" in q:
            out["budget"] = float(q["budget"])
            if not (math.isfinite(out["budget"]) and out["budget"] > 0):
                raise ValueError
    except ValueError:
        raise Refused(
            400, "bad_query", "samples: 1..2**20; scale: (0, 1]; budget: seconds > 0"
        ) from None
    return out
