"""Who may call the server: bearer tokens, the cross-site rule, and a slowdown for guessers.

Tokens travel in ``Authorization: Bearer``, never in cookies, so a browser never attaches them
by itself. What a hostile web page *can* do is make the user's browser send a simple POST
(form or text/plain body, no custom header) to a server on the user's network; such a request
must change nothing even when the API is open (no token, loopback). Hence every request that
may change state must carry a JSON or octet-stream content type and the ``X-Diloco-Client``
header: a browser sends a custom header cross-origin only after a CORS preflight, and this
server answers no preflight. A browser's ``Origin``, when present, must also name this server.

An open server (no token) answers only requests addressed to ``localhost`` or an IP literal:
a page whose own host name was re-pointed at 127.0.0.1 (DNS rebinding) is same-origin with the
server in the browser's eyes, so the rules above would not stop it, but its ``Host`` header
still carries its own name.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import HttpVersion11, web
from aiohttp.typedefs import Middleware

from diloco.edge.connections import address_key, vouch
from diloco.edge.log_limit import LogLimiter

log = logging.getLogger(__name__)

CLIENT_HEADER = "X-Diloco-Client"
DASHBOARD_CLIENT = "dashboard"  # the dashboard's CLIENT_HEADER (dashboard/app.js)
SAFE_METHODS = frozenset({"GET", "HEAD"})
ALLOWED_CONTENT_TYPES = frozenset({"application/json", "application/octet-stream"})
CONTROL_PREFIX = "/control/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Sent with every response: no sniffing, no framing (the dashboard's buttons cannot be
#: click-jacked), no referrer, and no page content other than the server's own files.
RESPONSE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
}


def _error(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status, headers=headers)


class AuthThrottle:
    """Counts failed authentications per remote address (an IPv6 /64) in a sliding window.

    After ``limit`` failures within ``window`` seconds, requests from the address without the
    right token are refused (429, and their connection closed) until its oldest counted
    failure leaves the window. A request with the right token is served all the same (the
    middleware checks it first): an address is shared by every process on a machine, and one
    that guesses must not shut out a worker beside it. What keeps a guesser from ever finding
    the token is its length (``secrets.token_urlsafe``); the throttle makes it pay a connection
    per guess and shows it in the log and ``/metrics``. The table is bounded so that many
    addresses cannot exhaust memory.
    """

    def __init__(
        self,
        limit: int = 5,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 4096,
        limiter: LogLimiter | None = None,
    ) -> None:
        self.limiter = limiter or LogLimiter()
        self.limit = limit
        self.window = window
        self.clock = clock
        self.max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self.total_failures = 0
        self.total_refused = 0

    def _recent(self, address: str, now: float) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        while times and now - times[0] >= self.window:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it may try now."""
        if self.limit <= 0:
            return None
        now = self.clock()
        times = self._recent(address, now)
        if times is None or len(times) < self.limit:
            return None
        return max(0.0, self.window - (now - times[0]))

    def failed(self, address: str) -> None:
        self.total_failures += 1
        if self.limit <= 0:
            return
        now = self.clock()
        times = self._recent(address, now)
        if times is None:
            times = self._failures[address] = deque(maxlen=self.limit)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)  # the least recently failing address
        else:
            self._failures.move_to_end(address)
        times.append(now)
        if len(times) == self.limit:
            self.limiter.log(
                log,
                logging.WARNING,
                "throttled",
                "%d failed authentications from %s within %.0f s: refusing its requests without "
                "the token for a while",
                self.limit,
                address,
                self.window,
            )


@dataclass(frozen=True)
class Guard:
    """The request rules of one server: its tokens, the paths open without one, the throttle."""

    token: str | None
    admin_token: str | None
    open_paths: frozenset[str]
    throttle: AuthThrottle
    limiter: LogLimiter = field(default_factory=LogLimiter)
    """Limits the lines that requests without the token add to the log."""

    @property
    def is_open(self) -> bool:
        """No token at all: anyone who can reach the socket may call the API."""
        return self.token is None and self.admin_token is None

    def _matches(self, given: bytes, secret: str | None) -> bool:
        if secret is None:
            return False
        # compare_digest: the time taken does not reveal how much of the token matched.
        return hmac.compare_digest(given, f"Bearer {secret}".encode())

    def authorized(self, request: web.Request) -> bool:
        control = request.path.startswith(CONTROL_PREFIX)
        needed = self.admin_token if control and self.admin_token is not None else self.token
        if needed is None:
            return True
        # aiohttp decodes header bytes with surrogateescape; encode them back the same way.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        # Both comparisons always run, so timing does not tell which token was close.
        ok_admin = self._matches(given, self.admin_token)
        ok_normal = self._matches(given, self.token)
        return ok_admin or (ok_normal and needed == self.token)


def _is_local_name(host: str) -> bool:
    """True for ``localhost`` and IP literals (with or without a port, IPv6 in brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host in ("localhost", "localhost."):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cross_site_refusal(request: web.Request) -> web.Response | None:
    """The 403 for a request a browser could have sent from another site, else None."""
    if request.method in SAFE_METHODS:
        return None
    content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type not in ALLOWED_CONTENT_TYPES or not request.headers.get(CLIENT_HEADER):
        return _error(
            403,
            "cross_site",
            f"state-changing requests need Content-Type application/json (or "
            f"application/octet-stream for tensors) and the header {CLIENT_HEADER}",
        )
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
        return _error(
            403, "cross_site", f"requests from origin {origin[:100]!r} are not accepted here"
        )
    return None


def rebinding_refusal(guard: Guard, request: web.Request) -> web.Response | None:
    """The 403 for a request to an open server under a host name other than a local one."""
    if not guard.is_open or _is_local_name(request.host):
        return None
    return _error(
        403,
        "bad_host",
        "this server has no token, so it answers only requests addressed to localhost or an IP "
        "address; start it with --token to serve other host names",
    )


def asks_for_a_token(request: web.Request) -> bool:
    """The dashboard's look at ``/status`` with no ``Authorization`` header at all: a page just
    opened, finding out whether it needs a token. It guesses nothing, so it is no failed
    authentication (no warning, not counted by the throttle); it still gets the 401 that makes
    the page ask for the token. A wrong token from the page, or any request without one from
    anything else (a worker started without its token), is a failure as before."""
    return (
        request.method == "GET"
        and request.path == "/status"
        and "Authorization" not in request.headers
        and request.headers.get(CLIENT_HEADER) == DASHBOARD_CLIENT
    )


def security_middleware(
    guard: Guard,
) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = rebinding_refusal(guard, request) or cross_site_refusal(request)
        if refusal is not None:
            return refusal
        if request.path in guard.open_paths:
            return await handler(request)
        if guard.authorized(request):
            # Checked before the throttle: failures from an address, a guesser's perhaps, never
            # shut out the holder of the token who shares it (a worker on the same machine).
            vouch(request)
            return await handler(request)
        address = address_key(request.remote)
        wait = guard.throttle.retry_after(address)
        if wait is not None:
            guard.throttle.total_refused += 1
            refusal = _error(
                429,
                "too_many_auth_failures",
                f"too many failed authentications from {address}; retry in {wait:.0f} s",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
            refusal.force_close()  # each further guess costs the guesser a new connection
            return refusal
        if asks_for_a_token(request):
            return _error(401, "unauthorized", "missing token (Authorization: Bearer ...)")
        guard.throttle.failed(address)
        control = request.path.startswith(CONTROL_PREFIX) and guard.admin_token is not None
        guard.limiter.log(
            log,
            logging.WARNING,
            "bad_token",
            "refused %s %s from %s: bad token",
            request.method,
            request.path[:200],
            address,
        )
        return _error(
            401,
            "unauthorized",
            "missing or wrong admin token (Authorization: Bearer ...); control endpoints "
            "need the admin token"
            if control
            else "missing or wrong token (Authorization: Bearer ...)",
        )

    return middleware


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """``Expect:`` handling for every route: ``100-continue`` or a JSON 417. (aiohttp's own
    handler echoes the value into a reply and fails with a 500 on bytes that are not UTF-8.)"""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() != "100-continue":
        return _error(417, "expectation_failed", "the only Expect value understood is 100-continue")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: the headers of ``RESPONSE_HEADERS`` on every reply."""
    for name, value in RESPONSE_HEADERS.items():
        response.headers.setdefault(name, value)
