"""Small JSON bodies: a request's read within its limit (its fields are then checked by its
message class), a reply written from its message."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from diloco.server.errors import ApiError, bad_request
from diloco.server.front import JSON_LIMIT
from diloco.wire.messages import Message


def too_large(limit: int, size: int | None = None) -> ApiError:
    what = f"a body of {size} bytes" if size is not None else "the body"
    return ApiError(413, "body_too_large", f"{what} exceeds the limit of {limit} bytes")


async def read_json(request: web.Request, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """The body as a JSON object; 413 past ``limit`` bytes, declared or actually sent."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"JSON bodies are limited to {limit} bytes")
    raw = bytearray()
    while len(raw) <= limit:  # read() returns what is buffered: loop to the end or the limit
        part = await request.content.read(limit + 1 - len(raw))
        if not part:
            break
        raw += part
    if len(raw) > limit:
        raise ApiError(413, "body_too_large", f"JSON bodies are limited to {limit} bytes")
    try:
        body = json.loads(bytes(raw) or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise bad_request("bad_json", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("bad_json", "the body must be a JSON object")
    return body


def reply(message: Message, status: int = 200) -> web.Response:
    """The JSON response of a message (``diloco.wire.messages``)."""
    return web.json_response(message.to_json(), status=status)
