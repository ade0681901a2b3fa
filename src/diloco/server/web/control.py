"""``POST /control/*``: an operator steers a running server. Thin: read the body as its message
class (``diloco.wire.messages``, strictly: an unknown field is refused, so a typo never passes for
a no-op), call the mode's front (which validates values and changes state), write its reply.
The security middleware requires the admin token here when one is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from diloco.server.errors import ApiError
from diloco.server.front import Front
from diloco.server.web.json_bodies import read_json, reply
from diloco.wire import messages
from diloco.wire.messages import (
    KickWorker,
    SaveState,
    ShuttingDown,
    UpdateNumWorkers,
    UpdateOptimizer,
)

log = logging.getLogger(__name__)

#: Called by ``/control/shutdown`` after its reply is sent; the argument says whether to save.
Shutdown = Callable[[bool], None]


def routes(front: Front, shutdown: Shutdown | None) -> list[web.RouteDef]:
    async def save_state(request: web.Request) -> web.Response:
        SaveState.from_json(await read_json(request))
        status, saved = await front.request_save()
        return reply(saved, status)

    async def kick_worker(request: web.Request) -> web.Response:
        kick = KickWorker.from_json(await read_json(request))
        return reply(front.membership.kick(kick.worker_id))

    async def update_optimizer(request: web.Request) -> web.Response:
        update = UpdateOptimizer.from_json(await read_json(request))
        params = front.parameters("the workers step the outer optimizer, set at their start")
        return reply(params.set_outer_hparams(lr=update.lr, momentum=update.momentum))

    async def update_num_workers(request: web.Request) -> web.Response:
        update = UpdateNumWorkers.from_json(await read_json(request))
        return reply(front.membership.set_num_workers(update.num_workers))

    async def shutdown_server(request: web.Request) -> web.StreamResponse:
        save = messages.Shutdown.from_json(await read_json(request)).save
        if shutdown is None:
            raise ApiError(501, "not_supported", "this server cannot be shut down remotely")
        round_ = front.status().round
        log.warning("control: shutdown requested (round %s, save=%s)", round_, save)
        response = reply(ShuttingDown(save=save, round=round_))
        # Sent before the stop begins: the runner's cleanup would otherwise race the reply.
        await response.prepare(request)
        await response.write_eof()
        shutdown(save)
        return response

    return [
        web.post("/control/save_state", save_state),
        web.post("/control/kick_worker", kick_worker),
        web.post("/control/update_optimizer", update_optimizer),
        web.post("/control/update_num_workers", update_num_workers),
        web.post("/control/shutdown", shutdown_server),
    ]
