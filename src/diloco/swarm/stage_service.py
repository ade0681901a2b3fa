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

Every call is idempotent per ``ID``, the stage steps once its samples are in, and while it
steps (with stage sync, a whole quorum round) calls are answered 503 ``syncing`` with
``retry_after`` seconds instead of waiting: the stage's side, on its one compute thread, is
``stage_calls.py``; this module is the HTTP edge.

Bounds: bodies up to ``max_body_bytes`` (413), read within ``body_timeout_s``; the token is
checked from the headers before a body byte is read; connections bounded in all and per address
before the token is shown, and a request head due within ``header_timeout_s`` (``diloco.edge``,
as the server's); the call tables' bounds are ``stage_calls.py``'s.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web
from torch import nn

from diloco.edge.connections import ConnectionTable, LimitedSite, vouch
from diloco.edge.tls import server_context
from diloco.swarm.stage_calls import Hook, LossFn, Refused, StageCalls, StageEdges, busy_refusal

__all__ = ["PREFIX", "Hook", "LossFn", "Refused", "StageEdges", "StageService"]

log = logging.getLogger(__name__)

PREFIX = "/swarm/stage/"
CALL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_SAMPLES = 1 << 20


class StageService(StageCalls):
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
        tls_cert: str | None = None,
        tls_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Built here, so a bad certificate or a key without one fails the constructor, before
        # any thread starts (and a half-configured TLS never falls back to plain HTTP).
        self._ssl = server_context(tls_cert, tls_key)
        super().__init__(
            stage,
            optimizer,
            edges,
            samples_per_step=samples_per_step,
            loss_fn=loss_fn,
            max_calls=max_calls,
            call_ttl_s=call_ttl_s,
            hook=hook,
            before_step=before_step,
            defer_steps=defer_steps,
            clock=clock,
        )
        self.token, self.host, self._port = token, host, port
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.header_timeout_s = header_timeout_s
        #: Connections bounded before the token is shown (``diloco.edge``, as the server's).
        self.connections = ConnectionTable(max_connections, max_connections_per_address)
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
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{self.host}:{self._port}"

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
            ssl_context=self._ssl,
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
            raise busy_refusal()
        job = self._pool.submit(self._work, kind, query, body, arrived)
        done: asyncio.Future[Any] = asyncio.wrap_future(job)
        busy: asyncio.Future[Any] = asyncio.ensure_future(self.gate.wait_busy())
        try:
            await asyncio.wait({done, busy}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            busy.cancel()
        if not done.done() and job.cancel():
            raise busy_refusal()  # never started: nothing of it ran
        return await done  # running already (it may be the one that steps): its answer

    def _authenticate(self, request: web.Request) -> None:
        if self.token is None:  # an open service (tests): every caller is trusted
            vouch(request)
            return
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            raise Refused(401, "unauthorized", "missing or wrong bearer token")
        vouch(request)  # a token holder's connection no longer counts against strangers'


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
