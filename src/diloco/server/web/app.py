"""HTTP routes. Thin: read the body as its message class (``diloco.wire.messages``: a body that
does not fit is a 400 naming the field), call the mode's front (``server/front.py``), write the
message it answers."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request
from diloco.server.front import JSON_LIMIT, Front
from diloco.server.observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diloco.server.observe.metrics import render as render_metrics
from diloco.server.params.store import ParamStore, Snapshot
from diloco.server.web import control, dashboard, rendezvous_routes, swarm_routes
from diloco.server.web.control import Shutdown
from diloco.server.web.counters import HttpCounters
from diloco.server.web.json_bodies import read_json, reply
from diloco.server.web.security import (
    AuthThrottle,
    Guard,
    Handler,
    add_response_headers,
    expect_handler,
    security_middleware,
)
from diloco.server.web.socket_body import DIRECT, SocketBody, defer_continue, direct_possible
from diloco.server.web.stall import StallGuard
from diloco.wire import WireError, aread_layout
from diloco.wire.decode import AsyncStream
from diloco.wire.encode import chunks
from diloco.wire.messages import (
    Deregister,
    ErrorBody,
    Heartbeat,
    Pending,
    QuorumAsk,
    QuorumOutcome,
    Register,
)

log = logging.getLogger(__name__)

DOWNLOAD_CHUNK = 1024 * 1024
FLUSH_AT_LEAST = 64 * 1024  # aiohttp drains the transport after a write of more than this
HEADER_LIMIT = 16 * 1024 * 1024
FRONT: web.AppKey[Front] = web.AppKey("front")
COUNTERS: web.AppKey[HttpCounters] = web.AppKey("counters", HttpCounters)
#: The liveness check stays open: it says only that the process answers.
OPEN_PATHS = frozenset({"/healthz"})
#: Routes whose body is tensors, taken from the socket where possible (server/web/socket_body.py).
TENSOR_UPLOADS = frozenset({"/submit_pseudograd", "/initial_params"})


def _error(status: int, code: str, detail: str) -> web.Response:
    return reply(ErrorBody(error=code, detail=detail), status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return reply(exc.reply, exc.status)
    except WireError as exc:
        return _error(exc.status, exc.code, exc.detail)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        raise
    except (ConnectionResetError, TimeoutError) as exc:
        # The client went away mid-request (a killed worker, a cut link). Nothing was counted;
        # one line is enough, and the answer below reaches no one.
        log.warning("%s %s: connection lost: %s", request.method, request.path, exc)
        return _error(400, "connection_lost", "the connection was lost during the request")
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _error(500, "internal", "the server hit an unexpected error; see its log")


@contextlib.asynccontextmanager
async def _tensor_body(
    request: web.Request, config: ServerConfig, payload_limit: int
) -> AsyncIterator[AsyncStream]:
    """The body of a tensor upload: from the socket where it can be (``socket_body``), else
    aiohttp's stream; either way dropped if the sender goes quiet or crawls (``StallGuard``)."""
    limit = HEADER_LIMIT + 8 + payload_limit
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(  # before 100 Continue: such a body is not even sent
            413,
            "body_too_large",
            f"body of {request.content_length} bytes exceeds the limit of {limit}",
        )
    direct = await SocketBody.open(request) if direct_possible(request) else None
    try:
        async with StallGuard(
            config.body_timeout, config.min_upload_rate, config.upload_rate_window
        ) as guard:
            yield guard.watch(request.content if direct is None else direct)
    except WireError as exc:
        # A worker died mid-upload, or its link crawls (or it is hostile): say so.
        if exc.code in ("body_timeout", "too_slow"):
            log.warning("%s from %s dropped: %s", request.path, request.remote, exc.detail)
        raise
    finally:
        if direct is not None:
            direct.close()


async def close_after_socket_body(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: aiohttp's parser never saw a body read from the socket
    and would take the next request for it, so that connection ends with its reply."""
    if request.get(DIRECT):
        response.force_close()
        response.headers["Connection"] = "close"  # the headers are built before this hook


async def register(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    asked = Register.from_json(await read_json(request, front.register_limit))
    hostname = asked.hostname or request.remote or "?"
    return reply(front.membership.register(asked, hostname))


async def deregister(request: web.Request) -> web.Response:
    leaving = Deregister.from_json(await read_json(request))
    return reply(request.app[FRONT].membership.deregister(leaving.worker_id))


async def heartbeat(request: web.Request) -> web.Response:
    beat = Heartbeat.from_json(await read_json(request))
    return reply(request.app[FRONT].membership.heartbeat(beat))


async def quorum(request: web.Request) -> web.Response:
    """All-reduce and swarm mode: a long poll for this round's quorum
    (server/allreduce/quorum_book.py; swarm mode: server/swarm/stage_quorums.py)."""
    quorums = request.app[FRONT].quorums()
    ask = QuorumAsk.from_json(await read_json(request))
    assigned = await quorums.quorum(ask)
    if assigned is None:
        return reply(Pending(round=quorums.round_of(ask.worker_id)), 202)
    return reply(assigned)


async def quorum_outcome(request: web.Request) -> web.Response:
    quorums = request.app[FRONT].quorums()
    return reply(quorums.outcome(QuorumOutcome.from_json(await read_json(request))))


async def submit_pseudograd(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    params = front.parameters("pseudo-gradients are averaged among the workers")
    params.require_store()
    async with _tensor_body(request, front.config, params.upload_limit()) as body:
        layout = await aread_layout(body, HEADER_LIMIT)
        receipt = await params.submit(layout, body)
    return reply(receipt)


async def initial_params(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    params = front.parameters("the workers hold the parameters; the server takes none")
    worker_id = request.query.get("worker_id", "")
    async with _tensor_body(request, front.config, params.upload_limit()) as body:
        layout = await aread_layout(body, HEADER_LIMIT)
        seeded = await params.receive_initial(layout, body, worker_id)
    return reply(seeded)


async def global_params(request: web.Request) -> web.StreamResponse:
    """The global parameters, or with ``?fragment=k`` one fragment's pieces. Long-polls until
    ``min_round`` is published. ``have_round=R``: the round the worker holds, so that a lossy
    download codec can send the round's update instead (server/params/update_bodies.py). No lock
    is held while the bytes stream: the snapshot pins them and an outer step meanwhile writes to a
    copy."""
    params = request.app[FRONT].parameters("the server holds no parameters to send")
    worker_id = request.query.get("worker_id")
    have_round = (
        _query_int(request, "have_round", default=0) if "have_round" in request.query else None
    )
    snap = await params.download(
        worker_id,
        request.query.get("fragment"),
        lambda: _query_int(request, "min_round", default=0),
        have_round,
    )
    if isinstance(snap, Pending):  # nothing new within poll_timeout
        return reply(snap, 202)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = snap.total_size
        await resp.prepare(request)
        await resp.write(snap.header)
        await _write_pinned(request, resp, snap)
        await resp.write_eof()
    finally:
        ParamStore.close_snapshot(snap)
    snap.sent()
    return resp


async def _write_pinned(request: web.Request, resp: web.StreamResponse, snap: Snapshot) -> None:
    """Send the snapshot's payload from its pinned memory, and return only once no byte of it
    is still referenced by the transport, so that the pin may go.

    Writes are 1 MiB: Python 3.11's asyncio copies what the socket does not take at once into
    its buffer and shifts that buffer as it drains, so smaller writes cost less CPU than 4 MiB
    ones. Newer asyncio keeps references to the written memory instead of copying it, and an
    outer step may rewrite that memory in place once the pin is gone. So the last bytes go out
    as a copy, written with the transport's buffer limits at zero: aiohttp then waits until the
    transport's buffer is empty (all of it in the kernel's hands) before the write returns."""
    total = sum(len(body) for body in snap.body_parts)
    cut = total - min(total, FLUSH_AT_LEAST + 1)  # bytes from here on are sent as a copy
    tails: list[memoryview] = []
    sent = 0
    for body in snap.body_parts:
        for part in chunks(body, DOWNLOAD_CHUNK):
            keep = max(0, min(len(part), cut - sent))
            if keep:
                if snap.ready is not None:
                    await snap.ready(sent + keep)  # the round is still being written
                await resp.write(part[:keep])
            if keep < len(part):
                tails.append(part[keep:])
            sent += len(part)
    if not tails:
        return
    if snap.ready is not None:
        await snap.ready(total)
    tail = b"".join(tails)  # copied only now that every byte of it is final
    transport = request.transport
    limits = transport.get_write_buffer_limits() if transport is not None else None
    if transport is not None:
        transport.set_write_buffer_limits(high=0)
    try:
        await resp.write(tail)
    finally:
        if transport is not None and limits is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=limits[1], low=limits[0])


def _query_int(request: web.Request, key: str, default: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request("bad_query", f"query parameter {key!r} must be an integer") from None
    if value < 0:
        raise bad_request("bad_query", f"query parameter {key!r} must be >= 0")
    return value


async def status(request: web.Request) -> web.Response:
    # ``history_since``: the dashboard asks only for the loss history it has not drawn yet.
    since = _query_int(request, "history_since", 0)
    return web.json_response(request.app[FRONT].status(since).to_json())


async def metrics(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    text = render_metrics(front.status(), request.app[COUNTERS], front.metric_families)
    return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def not_found(request: web.Request) -> web.Response:
    raise ApiError(404, "not_found", "no such endpoint for this method")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(
    front: Front,
    config: ServerConfig | None = None,
    *,
    shutdown: Shutdown | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The server's routes behind its middleware: response counting, JSON errors, security."""
    config = config or front.config
    guard = Guard(
        token=config.token,
        admin_token=config.admin_token,
        # Open even with the dashboard off: its paths then answer 404 to anyone, not 401.
        open_paths=OPEN_PATHS | dashboard.PATHS,
        throttle=AuthThrottle(config.auth_failure_limit, config.auth_failure_window, clock),
    )
    counters = HttpCounters(
        auth_failures=lambda: guard.throttle.total_failures,
        auth_refused=lambda: guard.throttle.total_refused,
    )
    app = web.Application(
        middlewares=[counters.middleware(), errors_middleware, security_middleware(guard)],
        client_max_size=JSON_LIMIT,
    )
    app.on_response_prepare.append(add_response_headers)
    app.on_response_prepare.append(close_after_socket_body)
    app[FRONT] = front
    app[COUNTERS] = counters
    routes = [
        web.post("/register", register),
        web.post("/deregister", deregister),
        web.post("/heartbeat", heartbeat),
        web.post("/quorum", quorum),
        web.post("/quorum/outcome", quorum_outcome),
        web.post("/submit_pseudograd", submit_pseudograd),
        web.post("/initial_params", initial_params),
        web.get("/global_params", global_params),
        web.get("/status", status),
        web.get("/metrics", metrics),
        web.get("/healthz", healthz),
        *control.routes(front, shutdown),
        *rendezvous_routes.routes(front),
        *swarm_routes.routes(front),
        *(dashboard.routes() if config.dashboard_enabled else ()),
        web.route("*", "/{tail:.*}", not_found),  # last: JSON for every unknown path
    ]
    for r in routes:  # every route gets a safe Expect handler (GET routes also answer HEAD)
        if r.method == "GET":
            app.router.add_get(r.path, r.handler, expect_handler=expect_handler)
        else:
            expect = defer_continue if r.path in TENSOR_UPLOADS else expect_handler
            app.router.add_route(r.method, r.path, r.handler, expect_handler=expect)
    return app
