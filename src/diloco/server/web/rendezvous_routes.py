"""``POST /rendezvous/<op>``: all-reduce mode's rendezvous store (``server/allreduce/
rendezvous.py``, seen as ``front.QuorumKeys``) on the server's authenticated API. Thin: the mode
first (409 ``server_mode`` before a byte of the body is read), then the body as its message
class (``wire/messages/rendezvous.py``), the store's answer as its reply; every op passes the
call's ``position`` (the key space of one rank position within the quorum).

The bearer token is checked by the security middleware, as on every route; the store then
answers only a member of the quorum named. Bodies are bounded (``BODY_LIMIT``) before they are
read, and a wait is a long poll bounded by the collective timeout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from diloco.server.errors import ApiError
from diloco.server.front import Front, QuorumKeys
from diloco.server.web.json_bodies import read_json, reply
from diloco.wire.messages import (
    Message,
    StoreAdd,
    StoreCompareSet,
    StoreCount,
    StoreDelete,
    StoreDeleted,
    StoreDone,
    StoreGet,
    StoreNumber,
    StoreReady,
    StoreSet,
    StoreValue,
    StoreWait,
)
from diloco.wire.messages.rendezvous import B64_LIMIT, PATH, decode, encode

BODY_LIMIT = 2 * B64_LIMIT + 4096
"""A compare_set carries two values, plus the names."""

Op = Callable[[QuorumKeys, dict[str, Any]], Awaitable[Message]]


async def _set(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreSet.from_json(body)
    store.set(call.worker_id, call.quorum_id, call.key, decode(call.value), position=call.position)
    return StoreDone()


async def _get(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreGet.from_json(body)
    value = await store.get(
        call.worker_id, call.quorum_id, call.key, call.wait, position=call.position
    )
    return StoreValue(found=False) if value is None else StoreValue(found=True, value=encode(value))


async def _add(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreAdd.from_json(body)
    added = store.add(call.worker_id, call.quorum_id, call.key, call.amount, position=call.position)
    return StoreNumber(value=added)


async def _compare_set(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreCompareSet.from_json(body)
    held = store.compare_set(
        call.worker_id,
        call.quorum_id,
        call.key,
        decode(call.expected),
        decode(call.desired),
        position=call.position,
    )
    return StoreValue(found=True, value=encode(held))


async def _wait(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreWait.from_json(body)
    ready = await store.wait(
        call.worker_id, call.quorum_id, call.keys, call.wait, position=call.position
    )
    return StoreReady(ready=ready)


async def _delete(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreDelete.from_json(body)
    deleted = store.delete(call.worker_id, call.quorum_id, call.key, position=call.position)
    return StoreDeleted(deleted=deleted)


async def _count(store: QuorumKeys, body: dict[str, Any]) -> Message:
    call = StoreCount.from_json(body)
    return StoreNumber(value=store.count(call.worker_id, call.quorum_id, position=call.position))


OPS: dict[str, Op] = {
    "set": _set,
    "get": _get,
    "add": _add,
    "compare_set": _compare_set,
    "wait": _wait,
    "delete": _delete,
    "count": _count,
}


def _route(front: Front, op: Op) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        store = front.quorums().rendezvous
        if store is None:
            raise ApiError(503, "no_rendezvous", "the rendezvous is not served yet")
        return reply(await op(store, await read_json(request, BODY_LIMIT)))

    return handle


def routes(front: Front) -> list[web.RouteDef]:
    return [web.post(f"{PATH}/{name}", _route(front, op)) for name, op in OPS.items()]
