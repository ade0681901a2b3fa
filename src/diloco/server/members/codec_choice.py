"""The codec a worker uploads with, as it names it: in its registration (``registered_codec``,
checked against the codecs the mode takes, so a refused one is told at registration and not
mid-run) and in an upload's metadata (``server/intake/upload_body.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diloco.core.codecs import Codec, CodecError, codec_from_metadata
from diloco.server.errors import ApiError, bad_request

RAW = "raw"
"""The ``codec`` of a raw body, as clients before the codecs name it (or no ``codec`` key)."""
RAW_NAMES = {"F32": "fp32", "BF16": "bf16"}
"""The codec a raw tensor of that dtype amounts to (what ``--codecs`` must allow)."""


def codec_refused(name: str, allowed: Sequence[str]) -> ApiError:
    return ApiError(
        422,
        "codec_refused",
        f"this server does not take {name} uploads; it takes {', '.join(allowed)} "
        "(diloco server --codecs)",
        allowed=list(allowed),
    )


def parse_codec(metadata: Mapping[str, str]) -> Codec:
    try:
        return codec_from_metadata(metadata)
    except CodecError as exc:  # unknown_codec, bad_option
        raise bad_request(exc.code, exc.detail) from None


def registered_codec(info: Mapping[str, Any], allowed: Sequence[str]) -> str | None:
    """The codec a registering worker asks for in ``info["codec"]`` (``codec_metadata(codec)``),
    checked now so a refused one is told at registration, not mid-run: 400 for an unknown codec
    or option, 422 ``codec_refused`` for one this server does not allow. None: raw uploads (the
    worker asks for nothing, or ``raw``), refused only when neither fp32 nor bf16 is allowed."""
    asked = info.get("codec")
    if asked is None or asked == {"codec": RAW}:
        if not set(RAW_NAMES.values()) & set(allowed):
            raise codec_refused("raw (fp32/bf16)", allowed)
        return None
    if (
        not isinstance(asked, dict)
        or "codec" not in asked
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in asked.items())
    ):
        raise bad_request(
            "bad_field",
            "info['codec'] must be an object of strings with a 'codec' key, as "
            "codec_metadata(codec) gives ({'codec': 'int8', 'codec_block': '64'})",
        )
    codec = parse_codec(asked)
    if codec.name not in allowed:
        raise codec_refused(codec.name, allowed)
    return codec.name
