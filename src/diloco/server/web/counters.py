"""What only the HTTP layer sees, for ``/metrics`` (``server/observe/metrics.py``): responses by
status code, and refused authentications (read from the security guard's throttle)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Middleware

from diloco.server.web.security import Handler


@dataclass
class HttpCounters:
    """What the HTTP layer counts: responses by status code, refused authentications."""

    responses: Counter[int] = field(default_factory=Counter)
    auth_failures: Callable[[], int] = lambda: 0
    auth_refused: Callable[[], int] = lambda: 0

    def middleware(self) -> Middleware:
        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                self.responses[exc.status] += 1
                raise
            self.responses[response.status] += 1
            return response

        return count
