"""``POST /control/*``: an operator steers a running server. Thin: parse, validate the shape of
the body, call the mode's front (which validates values and changes state), reply in JSON.

Every body is a JSON object; unknown fields are refused, so a typo never passes for a no-op.
The security middleware requires the admin token here when one is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from diloco.server.errors import ApiError, bad_request
from diloco.server.front import Front
from diloco.server.web.json_bodies import number_field, only_fields, read_json, str_field

log = logging.getLogger(__name__)

#: Called by ``/control/shutdown`` after its reply is sent; the argument says whether to save.
Shutdown = Callable[[bool], None]


def routes(front: Front, shutdown: Shutdown | None) -> list[web.RouteDef]:
    async def save_state(request: web.Request) -> web.Response:
        only_fields(await read_json(request), set())
        status, reply = await front.request_save()
        return web.json_response(reply, status=status)

    async def kick_worker(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"worker_id"})
        worker_id = str_field(body, "worker_id")
        assert worker_id is not None
        return web.json_response({**front.membership.kick(worker_id), "kicked": worker_id})

    async def update_optimizer(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"lr", "momentum"})
        lr, momentum = number_field(body, "lr"), number_field(body, "momentum")
        if lr is None and momentum is None:
            raise bad_request("bad_field", "give 'lr', 'momentum' or both")
        params = front.parameters("the workers step the outer optimizer, set at their start")
        return web.json_response(params.set_outer_hparams(lr=lr, momentum=momentum))

    async def update_num_workers(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"num_workers"})
        value = body.get("num_workers")
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request("bad_field", "'num_workers' must be an integer")
        return web.json_response(front.membership.set_num_workers(value))

    async def shutdown_server(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        only_fields(body, {"save"})
        save = body.get("save", True)
        if not isinstance(save, bool):
            raise bad_request("bad_field", "'save' must be a boolean")
        if shutdown is None:
            raise ApiError(501, "not_supported", "this server cannot be shut down remotely")
        round_ = front.status().round
        log.warning("control: shutdown requested (round %s, save=%s)", round_, save)
        reply: dict[str, Any] = {"status": "shutting_down", "save": save, "round": round_}
        response = web.json_response(reply)
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
