"""Swarm mode's coordinator routes (``server/swarm/``, seen as ``front.Swarm``) on the server's
authenticated API: ``POST /swarm/ready``, ``GET /swarm/routes?version=N`` (a long poll bounded by
``poll_timeout``) and ``POST /swarm/suspect``. Thin: the mode first (409 ``not_swarm_mode``
before a byte of the body is read), then the body as its message class
(``wire/messages/swarm.py``), the front's answer as its reply.

The bearer token is checked by the security middleware, as on every route; bodies are bounded
before they are read (a ready message carries a stage's parameter table: ``READY_LIMIT``).
"""

from __future__ import annotations

from aiohttp import web

from diloco.server.errors import bad_request
from diloco.server.front import Front
from diloco.server.web.json_bodies import read_json, reply
from diloco.wire.messages.swarm import PATH, StageReady, SuspectReport

READY_LIMIT = 1024 * 1024
"""A stage's parameter table: a name and a shape per tensor."""
VERSION_LIMIT = 2**62


def routes(front: Front) -> list[web.RouteDef]:
    async def ready(request: web.Request) -> web.Response:
        swarm = front.swarm()
        return reply(swarm.stage_ready(StageReady.from_json(await read_json(request, READY_LIMIT))))

    async def table(request: web.Request) -> web.Response:
        swarm = front.swarm()
        raw = request.query.get("version", "-1")
        try:
            version = int(raw)
        except ValueError:
            version = VERSION_LIMIT + 1
        if not -1 <= version <= VERSION_LIMIT:
            raise bad_request(
                "bad_query",
                "query parameter 'version' must be an integer >= -1 (the version held; -1 or "
                "absent: none, answered at once)",
            )
        return reply(await swarm.routes(version))

    async def suspect(request: web.Request) -> web.Response:
        swarm = front.swarm()
        return reply(swarm.suspect(SuspectReport.from_json(await read_json(request))))

    return [
        web.post(f"{PATH}/ready", ready),
        web.get(f"{PATH}/routes", table),
        web.post(f"{PATH}/suspect", suspect),
    ]
