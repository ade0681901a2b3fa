"""``POST /control/*``: an operator steers a running server. Thin: parse, validate the shape of
the body, call the coordinator (which validates values and changes state), reply in JSON.

Every body is a JSON object; unknown fields are refused, so a typo never passes for a no-op.
The security middleware requires the admin token here when one is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from diloco.server.bodies import number_field, only_fields, read_json, str_field
from diloco.server.coordinator import Coordinator
from diloco.server.errors import ApiError, bad_request
from diloco.server.status import build_status

log = logging.getLogger(__name__)

#: Called by ``/control/shutdown`` after its reply is sent; the argument says whether to save.
Shutdown = Callable[[bool], None]


def routes(coordinator: Coordinator, shutdown: Shutdown | None) -> list[web.RouteDef]:
    coord = coordinator

    async def save_state(request: web.Request) -> web.Response:
        only_fields(await read_json(request), set())
        if coord.allreduce is not None:  # the workers hold the state: rank 0 of a quorum saves
            reply = coord.allreduce.book.request_save()
            log.info("control: checkpoint requested of the next quorum (round %s)", reply["round"])
            return web.json_response(reply, status=202)
        if coord.config.save_dir is None:
            raise ApiError(
                409, "no_save_dir", "the server was started without --save-dir; nothing to save to"
            )
        try:
            path = await coord.save()
        except OSError as exc:
            raise ApiError(
                500, "save_failed", f"the checkpoint could not be written: {exc}"
            ) from exc
        if path is None:
            raise ApiError(
                409,
                "nothing_to_save",
                "the server has no parameters yet (or no worker has set up the run): nothing to save",
            )
        round_ = build_status(coord).round
        log.info("control: state saved to %s (round %s)", path, round_)
        return web.json_response({"status": "ok", "path": str(path), "round": round_})

    async def kick_worker(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"worker_id"})
        worker_id = str_field(body, "worker_id")
        assert worker_id is not None
        return web.json_response({**coord.kick(worker_id), "kicked": worker_id})

    async def update_optimizer(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"lr", "momentum"})
        lr, momentum = number_field(body, "lr"), number_field(body, "momentum")
        if lr is None and momentum is None:
            raise bad_request("bad_field", "give 'lr', 'momentum' or both")
        return web.json_response(coord.set_outer_hparams(lr=lr, momentum=momentum))

    async def update_num_workers(request: web.Request) -> web.Response:
        body = await read_json(request)
        only_fields(body, {"num_workers"})
        value = body.get("num_workers")
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request("bad_field", "'num_workers' must be an integer")
        return web.json_response(coord.set_num_workers(value))

    async def shutdown_server(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        only_fields(body, {"save"})
        save = body.get("save", True)
        if not isinstance(save, bool):
            raise bad_request("bad_field", "'save' must be a boolean")
        if shutdown is None:
            raise ApiError(501, "not_supported", "this server cannot be shut down remotely")
        round_ = build_status(coord).round
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
