"""Reading small JSON request bodies within their limit, and checking their fields."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from diloco.server.errors import ApiError, bad_request
from diloco.server.front import JSON_LIMIT


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


def str_field(
    body: dict[str, Any], key: str, *, required: bool = True, limit: int = 256
) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > limit:
        raise bad_request(
            "bad_field", f"{key!r} must be a non-empty string of at most {limit} characters"
        )
    return value


def number_field(body: dict[str, Any], key: str) -> float | None:
    """An optional JSON number (not a boolean); None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request("bad_field", f"{key!r} must be a number")
    return float(value)


def only_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(
            "bad_field",
            f"unknown field(s) {', '.join(map(repr, unknown))}; expected {sorted(allowed)}",
        )
