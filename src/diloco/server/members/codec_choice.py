"""The codec a worker uploads with, as it names it: in its registration (``registered_codec``,
checked against the codecs the mode takes, so a refused one is told at registration and not
mid-run) and in an upload's metadata (``server/intake/upload_body.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diloco.core.codecs import Codec, CodecError, codec_from_metadata
from diloco.server.errors import ApiError, bad_request

RAW = "raw"
"""The ``codec`` of a raw body, as clients before the codecs name it (or no ``codec`` key)."""
RAW_NAMES = {"F32": "fp32", "BF16": "bf16"}
"""The codec a raw tensor of that dtype amounts to (what ``--codecs`` must allow)."""


SERVER_CODECS = "diloco server --codecs"
"""Where a refused codec's allowed list comes from, in server mode."""


def codec_refused(name: str, allowed: Sequence[str], why: str = SERVER_CODECS) -> ApiError:
    return ApiError(
        422,
        "codec_refused",
        f"this server does not take {name} uploads; it takes {', '.join(allowed)} ({why})",
        allowed=tuple(allowed),
    )


def parse_codec(metadata: Mapping[str, str]) -> Codec:
    try:
        return codec_from_metadata(metadata)
    except CodecError as exc:  # unknown_codec, bad_option
        raise bad_request(exc.code, exc.detail) from None


def registered_codec(
    asked: Mapping[str, str] | None, allowed: Sequence[str], why: str = SERVER_CODECS
) -> str | None:
    """The codec a registering worker asks for (``RegisterInfo.codec``, ``codec_metadata(codec)``,
    its shape checked by the message), checked now so a refused one is told at registration, not
    mid-run: 400 for an unknown codec or option, 422 ``codec_refused`` for one this server does
    not allow, its detail ending with ``why`` (where the allowed list comes from). None: raw
    uploads (the worker asks for nothing, or ``raw``), refused only when neither fp32 nor bf16
    is allowed."""
    if asked is None or asked == {"codec": RAW}:
        if not set(RAW_NAMES.values()) & set(allowed):
            raise codec_refused("raw (fp32/bf16)", allowed, why)
        return None
    codec = parse_codec(asked)
    if codec.name not in allowed:
        raise codec_refused(codec.name, allowed, why)
    return codec.name
