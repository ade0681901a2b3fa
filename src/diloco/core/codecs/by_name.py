"""Codecs by name: what travels in a body's ``__metadata__``, and the body's tensors.

The metadata of an encoded body names its codec and options as strings, ``codec`` and
``codec_<option>`` keys, beside whatever else the body's metadata holds (worker id, round):
``{"codec": "int8", "codec_block": "64"}``. ``codec_from_metadata`` rebuilds an equal codec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from diloco.core.codecs.base import Codec, CodecError, check_name
from diloco.core.codecs.elementwise import Bf16Codec, BlockCodec, Fp32Codec
from diloco.core.codecs.fourbit import Int4Codec
from diloco.core.codecs.lowrank import LowRankCodec
from diloco.core.codecs.quant import Int8Codec
from diloco.core.codecs.topk import TopKCodec

FOUR_BIT = "int4"
"""The registered 4-bit codec (uniform int4 over E2M1 ``fp4``: docs/design/codecs.md)."""

CODECS: dict[str, Callable[..., Codec]] = {
    "fp32": Fp32Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    FOUR_BIT: Int4Codec,
    "lowrank": LowRankCodec,
    "topk": TopKCodec,
}
PREFIX = "codec_"
OPTION_TYPES: dict[str, type] = {
    "block": int,
    "rank": int,
    "seed": int,
    "fallback_block": int,
    "chunk": int,
    "bits": int,
    "density": float,
    "index_bits": int,
}
"""How the numeric options' metadata strings are read; any other option stays a string."""


def codec_names() -> list[str]:
    return list(CODECS)


def codec_by_name(name: str, **options: Any) -> Codec:
    """A new codec of that name; ``options`` go to its constructor (``block=128``, ``rank=8``,
    ``fallback="bf16"``, ``density=0.0156``). A ``ValueError`` naming the known codecs for any
    other name."""
    if name not in CODECS:
        raise CodecError(
            "unknown_codec", f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}"
        )
    if name == "lowrank":
        fallback = options.pop("fallback", None)
        if isinstance(fallback, str):
            fb_opts = {
                k[len("fallback_") :]: options.pop(k)
                for k in list(options)
                if k.startswith("fallback_")
            }
            built = codec_by_name(fallback, **fb_opts)
            if not isinstance(built, BlockCodec):
                raise CodecError("bad_option", f"low-rank fallback {fallback!r} is not piecewise")
            fallback = built
        options["fallback"] = fallback
    try:
        return CODECS[name](**options)
    except CodecError:
        raise
    except (TypeError, ValueError) as exc:  # an unknown option, or a bad value of one
        raise CodecError("bad_option", f"codec {name!r}: {exc}") from None


def codec_metadata(codec: Codec) -> dict[str, str]:
    """``__metadata__`` entries naming ``codec``: ``{"codec": name, "codec_<option>": value}``."""
    return {"codec": codec.name, **{PREFIX + k: v for k, v in codec.options().items()}}


def codec_from_metadata(metadata: Mapping[str, str], *, from_peer: bool = True) -> Codec:
    """The codec a body's metadata names (``fp32`` when it names none: a body from before the
    codecs). A ``CodecError`` for an unknown codec or option, or (``from_peer``: metadata a
    peer sent, not a user's spelling) one that leaves out a ``required_options`` entry."""
    name = metadata.get("codec", "fp32")
    raw = {k[len(PREFIX) :]: v for k, v in metadata.items() if k.startswith(PREFIX)}
    required: tuple[str, ...] = (
        getattr(CODECS.get(name), "required_options", ()) if from_peer else ()
    )
    missing = [k for k in required if k not in raw]
    if missing:
        raise CodecError(
            "bad_option",
            f"codec {name!r} must name {', '.join(PREFIX + k for k in missing)} (its wire format; "
            f"a peer without it is from an older diloco and must be upgraded)",
        )
    options: dict[str, Any] = {}
    for key, value in raw.items():
        kind = OPTION_TYPES.get(key)
        if kind is None:
            options[key] = value
            continue
        try:
            options[key] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise CodecError("bad_option", f"codec option {key}={value!r} is not {what}") from None
    return codec_by_name(name, **options)


def to_wire(
    name: str, codec: Codec, shape: Sequence[int], parts: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{wire name: tensor}`` of one encoded tensor of ``shape`` (``name``, ``name@scale``...)."""
    check_name(name)
    return {name + p.suffix: t for p, t in zip(codec.parts(shape), parts, strict=True)}


def from_wire(
    tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int], codec: Codec
) -> list[torch.Tensor]:
    """The parts of parameter ``name`` (of ``shape``) among a body's ``tensors``, in ``parts``
    order, checked (layout and values). A ``CodecError`` when one is missing or wrong."""
    expected = codec.parts(shape)
    missing = [name + p.suffix for p in expected if name + p.suffix not in tensors]
    if missing:
        raise CodecError("bad_parts", f"the body lacks {', '.join(missing)}")
    parts = [tensors[name + p.suffix] for p in expected]
    codec.check(parts, shape)
    return parts


def encode_named(
    codec: Codec, named: Mapping[str, torch.Tensor], feedback: Any = None
) -> dict[str, torch.Tensor]:
    """Every tensor of ``named`` encoded (through ``feedback.encode`` when given an
    ``ErrorFeedback``), as one dict of wire tensors: ``safetensors.torch.save`` takes it as it
    is, with ``metadata=codec_metadata(codec)``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        parts = codec.encode(t, name) if feedback is None else feedback.encode(codec, name, t)
        out.update(to_wire(name, codec, t.shape, [p.contiguous() for p in parts]))
    return out


def decode_named(
    codec: Codec, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The inverse of ``encode_named`` for parameters of the given ``shapes``, checked."""
    return {
        name: codec.decode(from_wire(tensors, name, shape, codec), shape)
        for name, shape in shapes.items()
    }
