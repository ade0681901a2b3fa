"""DiLoCoServer: the mode's front (``server/front.py``, picked in ``make_front``) and its HTTP app
on an event loop, in the foreground or a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch
from aiohttp import web

from diloco.edge.connections import ConnectionTable, LimitedSite, default_max_connections
from diloco.edge.log_limit import LogLimiter, limit_loop_errors
from diloco.edge.tls import server_context
from diloco.server.allreduce.allreduce_front import AllReduceFront
from diloco.server.config import ServerConfig
from diloco.server.front import Front
from diloco.server.paramserver.coordinator import OptimizerFactory
from diloco.server.paramserver.startup import start_coordinator
from diloco.server.relay.front import start_relay
from diloco.server.swarm.swarm_front import SwarmFront
from diloco.server.web.app import build_app

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LINE_SIZE = 8190
"""Longest request line (and so URL) accepted, bytes."""
MAX_FIELD_SIZE = 8190
"""Longest header field accepted, bytes."""
MAX_HEADERS = 64
"""Most header fields in one request."""
SEND_BUFFER_BYTES = 4 * 1024 * 1024
"""SO_SNDBUF of every connection (Linux grants twice this; the usual autotuned ceiling is 4 MiB).
Downloads are written in 1 MiB pieces; a send buffer that takes each piece whole saves asyncio
copying the part the socket refused into its own buffer and coming back for it, and lets a
1 Gbit link with tens of milliseconds of round trip stay full. It is a ceiling, not memory held:
the kernel only uses it for bytes queued. On the 100M benchmark, N=4, the server's CPU per round
went from about 1.27 to 1.10 s (docs/benchmarks-log.md). Set only where the system lets a socket
have that much (``net.core.wmem_max``): a smaller grant would be fixed below what autotuning
reaches by itself. A stock kernel allows 208 KiB, so there nothing is set unless an operator
raises the limit (``sysctl net.core.wmem_max=4194304``)."""


def _wmem_max() -> int | None:
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or not readable: leave the kernel's defaults alone


def send_buffer_allowed(wmem_max: int | None) -> bool:
    """Whether SO_SNDBUF = SEND_BUFFER_BYTES is granted in full: setting it also turns the
    kernel's send-buffer autotuning off, so a capped grant would leave downloads worse off."""
    return wmem_max is not None and wmem_max >= SEND_BUFFER_BYTES


def browser_url(config: ServerConfig, port: int, hostname: str | None = None) -> str:
    """The server's address as a person's browser can open it: ``scheme://host:port``.

    Bound to every interface (``0.0.0.0``, ``::``), the machine's name stands in (``hostname``,
    default ``socket.gethostname()``): ``0.0.0.0`` cannot be opened. A server without a token
    answers only local names and IP addresses (DNS rebinding, server/web/security.py), so there
    the loopback address, which works at least from this machine."""
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        has_token = config.token is not None or config.admin_token is not None
        host = (hostname or socket.gethostname() or "127.0.0.1") if has_token else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    scheme = "https" if config.tls_cert else "http"
    return f"{scheme}://{host}:{port}"


def make_front(
    config: ServerConfig,
    initial_params: dict[str, torch.Tensor] | None = None,
    outer_optimizer_factory: OptimizerFactory | None = None,
) -> Front:
    """The one place that picks the mode's front from the settings: a new mode is a new front
    here, and nothing else asks which mode runs."""
    if config.swarm:
        if initial_params is not None:
            raise ValueError("initial_params: the server holds no parameters in swarm mode")
        return SwarmFront(config)
    if config.allreduce:
        if initial_params is not None:
            raise ValueError("initial_params: the server holds no parameters in all-reduce mode")
        return AllReduceFront(config)
    if config.upstream is not None:
        if initial_params is not None or outer_optimizer_factory is not None:
            raise ValueError(
                "initial_params, outer_optimizer_factory: a relay (upstream) takes its parameters "
                "from the upstream and steps no outer optimizer"
            )
        return start_relay(config)
    return start_coordinator(config, initial_params, outer_optimizer_factory)


#: The reference's ``DiLoCoServer`` keywords whose setting has another name here.
REFERENCE_KEYWORDS = {"async_mode": "mode", "dylu_enabled": "dylu"}


def config_of(
    config: ServerConfig | str | os.PathLike[str] | None, keywords: dict[str, Any]
) -> ServerConfig:
    """The server's settings: a ``ServerConfig``, or ``ServerConfig`` fields as keywords after
    an optional model/output folder, the reference's ``DiLoCoServer("path/to/model",
    num_workers=3, async_mode=True, ...)`` form (``async_mode`` and ``dylu_enabled`` are
    ``mode`` and ``dylu`` here). Raises TypeError, naming the fields, for keywords that are none."""
    if isinstance(config, ServerConfig):
        if keywords:
            raise TypeError(
                f"DiLoCoServer: give {', '.join(sorted(keywords))} in the ServerConfig, not "
                "beside it"
            )
        return config
    fields = {REFERENCE_KEYWORDS.get(k, k): v for k, v in keywords.items()}
    if "mode" in fields and isinstance(fields["mode"], bool):  # async_mode=True/False
        fields["mode"] = "async" if fields["mode"] else "sync"
    if config is not None:
        if not isinstance(config, str | os.PathLike):
            raise TypeError(
                f"DiLoCoServer takes a ServerConfig or a model/output folder, got {type(config)!r}"
            )
        fields["output_dir"] = os.fspath(config)
    known = ServerConfig.__dataclass_fields__
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        raise TypeError(
            f"DiLoCoServer: unknown setting(s) {', '.join(unknown)}; the settings are "
            f"ServerConfig's fields ({', '.join(known)}); docs/migrating.md maps the "
            "reference's names"
        )
    return ServerConfig(**fields)


class DiLoCoServer:
    """A synchronous DiLoCo parameter server.

    >>> server = DiLoCoServer(ServerConfig(port=0, num_workers=2))
    >>> server.start(); server.address  # doctest: +SKIP
    '127.0.0.1:40123'
    """

    def __init__(
        self,
        config: ServerConfig | str | os.PathLike[str] | None = None,
        *,
        initial_params: dict[str, torch.Tensor] | None = None,
        outer_optimizer_factory: OptimizerFactory | None = None,
        **settings: Any,
    ) -> None:
        self.config = config_of(config, settings)
        self.front = make_front(self.config, initial_params, outer_optimizer_factory)
        # The first torch optimizer built in a process imports torch._dynamo (about 0.8 s). Pay
        # for it here, not on the event loop when the first worker registers or uploads.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.connections: ConnectionTable | None = None
        self._stopped: asyncio.Event | None = None
        self._port: int | None = None
        self._save_on_stop = True
        self._done = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------------

    async def _serve(self, ready: threading.Event | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        limit_loop_errors(self._loop, LogLimiter())  # accept() failures, say, once per interval
        if self._stopped is None:
            self._stopped = asyncio.Event()
        app = build_app(self.front, self.config, shutdown=self._request_shutdown)
        # Handlers are not cancelled when a client disconnects: an upload being added to the
        # round's sum must finish, and long polls end by themselves within poll_timeout.
        # On shutdown, handlers still running (long polls) get a few seconds, then are cancelled.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=3.0,
            # Header limits: a request line or header field past 8 KiB is refused by the
            # parser. Bodies are never decompressed: nothing here sends them compressed, and a
            # small gzip body must not expand past the limits checked on what was sent.
            max_line_size=MAX_LINE_SIZE,
            max_field_size=MAX_FIELD_SIZE,
            max_headers=MAX_HEADERS,
            auto_decompress=False,
            # aiohttp closes a connection still waiting for a complete request head this long
            # after it opened or its last reply: the header deadline (edge/connections.py).
            keepalive_timeout=self.config.header_timeout,
        )
        await self._runner.setup()
        self.connections = ConnectionTable(
            self.config.max_connections or default_max_connections(),
            self.config.max_connections_per_ip,
        )
        site = LimitedSite(
            self._runner,
            self.config.host,
            self.config.port,
            self.connections,
            ssl_context=self._ssl_context(),
            handshake_timeout=self.config.header_timeout,
        )
        await site.start()
        try:  # before the next await: no request is handled before the front is open
            self.front.open()
        except BaseException:
            await self._runner.cleanup()
            raise
        sockets = getattr(site._server, "sockets", None)
        assert sockets, "the site has no listening socket"
        self._port = int(sockets[0].getsockname()[1])
        if send_buffer_allowed(_wmem_max()):
            for sock in sockets:  # accepted connections inherit it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        log.info(
            "diloco server listening on %s:%d (waiting for %d workers)",
            # The interface bound (0.0.0.0: all of them), not ``address``, which names one a
            # local client can dial.
            self.config.host if ":" not in self.config.host else f"[{self.config.host}]",
            self.port,
            self.config.num_workers,
        )
        if self.config.dashboard_enabled:
            log.info("Dashboard: %s/dashboard", browser_url(self.config, self._port))
        if ready is not None:
            ready.set()
        periodic = asyncio.get_running_loop().create_task(self.front.run())
        try:
            await self._stopped.wait()
        finally:
            periodic.cancel()
            if self._save_on_stop:
                try:
                    await self.front.save()
                except Exception:
                    log.exception("saving on shutdown failed")
            await self._runner.cleanup()
            self.front.close()
            self._done.set()

    def _ssl_context(self) -> ssl.SSLContext | None:
        return server_context(self.config.tls_cert, self.config.tls_key)

    def _request_shutdown(self, save: bool) -> None:
        """From ``/control/shutdown``, on the event loop: stop serving, saving first if asked."""
        self._save_on_stop = save
        if self._stopped is not None:
            self._stopped.set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (after a remote shutdown, say); True if it has."""
        return self._done.wait(timeout)

    def start(self, timeout: float = 30.0) -> DiLoCoServer:
        """Serve from a background thread; returns once the socket is bound."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(self._serve(ready))
            except BaseException as exc:  # surfaced to start()'s caller
                failure.append(exc)
                ready.set()

        self._thread = threading.Thread(target=main, name="diloco-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("server did not start in time")
        if failure:
            raise failure[0]
        return self

    def run(self) -> None:
        """Serve in the foreground until SIGINT or SIGTERM."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            stopped = self._stopped = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopped.set)
            await self._serve()

        asyncio.run(main())

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving (saving first when a save_dir is set). Safe to call twice."""
        loop, stopped = self._loop, self._stopped
        if loop is None or stopped is None:
            return
        if not self._done.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (remote shutdown)
                loop.call_soon_threadsafe(stopped.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._loop = None
        self._stopped = None

    def __enter__(self) -> DiLoCoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inspection (thread-safe) -------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """``http://host:port``, or ``https://`` when serving TLS."""
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{self.address}"

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        if self._loop is None:
            raise RuntimeError("server not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def status(self) -> dict[str, Any]:
        async def get() -> dict[str, Any]:
            return self.front.status().to_json()

        return self._call(get())

    def save_state(self) -> str | None:
        """Write a checkpoint now; returns its path (None without a save_dir)."""
        path = self._call(self.front.save())
        return str(path) if path is not None else None

    def global_params(self, *, true: bool = False) -> dict[str, torch.Tensor]:
        """fp32 copies of the current global parameters: those published (what ``GET
        /global_params`` serves), or with ``true`` the outer optimizer's own copy (they differ
        with a lossy ``download_codec``, by about one round's quantization)."""

        async def get() -> dict[str, torch.Tensor]:
            store = self.front.parameters("the server holds no parameters").require_store()
            snap = await store.open_snapshot()
            try:
                return store.copy_true() if true else store.copy_out()
            finally:
                store.close_snapshot(snap)

        return self._call(get())
