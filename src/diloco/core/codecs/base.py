"""What every codec is: the wire parts of an encoded tensor, the interface, the errors.

An encoded tensor travels as one or more wire tensors (its *parts*) in the same safetensors body:
the part with suffix ``""`` is named like the parameter, the others append a suffix that starts
with ``SEP`` (``"fc.weight@scale"``). PyTorch forbids only ``"."`` in module names, so ``"@"``
could in principle occur in a parameter name; :func:`check_name` refuses such a name, which is
what keeps a part's wire name from ever meaning another parameter.

Contract shared by every codec (each method says its own):

- ``parts(shape)`` depends on the shape (and the codec's options) alone, so the server can check a
  body's header against it before it reads a byte of payload;
- ``encode`` then ``add_into`` is the whole data path; ``decode`` is ``add_into`` into a fresh
  tensor with weight 1, so decoding and accumulating share their arithmetic bit for bit;
- a codec holds no scratch between calls: one instance may serve several threads, except the
  low-rank codec, whose warm-start state changes on every ``encode``. A caller that encodes or
  decodes again and again passes its own ``Workspace`` to the piecewise calls instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from diloco.core.workspace import Workspace

SEP = "@"
"""Separator between a parameter's name and a part's suffix on the wire."""

CHUNK = 1 << 20
"""Elements processed at a time (the worker's ``PIECE``, the server's ``accumulate.CHUNK``):
large enough that per-operation overhead stops mattering, small enough that a chunk's several
passes stay in the last-level cache and memory is crossed about once. benchmarks/codecs/speed.py
on one core, 100M parameters, int8 encode: 2**17: 4.0x the bf16 cast, 2**18: 3.3x, 2**19: 2.7x,
2**20: 2.6x, 2**21: 2.8x. A power of two: a multiple of every block and of the 4-bit group."""


@dataclass(frozen=True)
class Part:
    """One wire tensor of an encoded tensor."""

    suffix: str
    """``""`` for the part named like the parameter, else ``SEP`` and a word (``"@scale"``)."""
    dtype: torch.dtype
    """Its dtype on the wire."""
    shape: tuple[int, ...]
    """Its shape on the wire."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class CodecError(ValueError):
    """A body's parts do not fit the codec. ``code`` is machine-readable:

    - ``"bad_parts"``: the wrong number of parts, or a name the codec does not know;
    - ``"bad_dtype"`` / ``"bad_shape"``: a part's dtype or shape differs from ``parts(shape)``;
    - ``"bad_scale"``: a negative quantization scale (never produced by an encoder);
    - ``"bad_index"``: a sparse codec's index outside its chunk, repeated or out of order;
    - ``"non_finite"``: a scale or factor is NaN or infinite, or large enough that a decoded value
      would be (the server answers 422; every other code is a malformed body, 400).
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def check_name(name: str) -> str:
    """``name`` itself, when it can travel beside codec parts; a ``ValueError`` when it contains
    ``SEP``, since ``name + "@scale"`` could then be another parameter's part."""
    if SEP in name:
        raise ValueError(
            f"parameter name {name!r} contains {SEP!r}, which separates a parameter's name from "
            "its codec parts on the wire; rename the module or parameter"
        )
    return name


def wire_names(name: str, parts: Sequence[Part]) -> list[str]:
    """The wire name of each part of parameter ``name``."""
    return [check_name(name) + p.suffix for p in parts]


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Codec:
    """One way to put an fp32 tensor on the wire. Subclasses set ``name`` (the string in the
    body's ``__metadata__``) and ``lossy`` (whether ``decode(encode(t))`` may differ from ``t``:
    the worker keeps an error-feedback residual for lossy codecs)."""

    name: ClassVar[str]
    lossy: ClassVar[bool]
    required_options: ClassVar[tuple[str, ...]] = ()
    """Options a body's metadata must name (``codec_from_metadata``): those that mark a wire
    format, so a peer from before it is refused by name instead of misread."""

    def options(self) -> dict[str, str]:
        """The codec's options as metadata strings (``{"block": "64"}``): with ``name`` they
        rebuild an equal codec (``registry.codec_from_metadata``)."""
        return {}

    def parts(self, shape: Sequence[int]) -> list[Part]:
        """The wire tensors an encoded tensor of ``shape`` is made of, in the order a body should
        carry them (scales and factors first, so a receiver can check them before the codes)."""
        raise NotImplementedError

    def encode(self, t: torch.Tensor, name: str = "") -> list[torch.Tensor]:
        """``t`` (fp32, any device) encoded: tensors matching ``parts(t.shape)`` in order, on
        ``t``'s device. ``name`` keys per-tensor state (the low-rank warm start); stateless
        codecs ignore it. ``t`` is not modified."""
        raise NotImplementedError

    def add_into(
        self,
        acc: torch.Tensor,
        parts: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        first: bool = False,
        work: Workspace | None = None,
    ) -> None:
        """``acc += weight * decode(parts)`` in place (``acc = ...`` when ``first``), in chunks of
        about ``CHUNK`` elements and with scratch of that size only, never a full-size temporary:
        the server's memory stays flat in the number of workers. ``acc`` is a contiguous fp32
        tensor with the encoded tensor's shape (or its flat view). Same bits as
        ``accumulate_(acc, decode(parts, acc.shape), weight, first)``. Parts are not checked here:
        call ``check`` first on anything that came from the network. ``work``: the caller's
        reused scratch (``core.workspace``; None: allocated for this call)."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, parts: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """The fp32 tensor of ``shape`` that ``parts`` stand for, on the parts' device."""
        out = torch.empty(tuple(shape), dtype=torch.float32, device=parts[0].device)
        self.add_into(out, parts, 1.0, first=True)
        return out

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of payload an encoded tensor of ``shape`` puts on the wire."""
        return sum(p.nbytes for p in self.parts(shape))

    def check_layout(
        self, shape: Sequence[int], layouts: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> None:
        """Raise ``CodecError`` unless ``layouts`` (``(dtype, shape)`` of each part, in the order
        of ``parts(shape)``, as a body's header declares them) is what ``parts(shape)`` expects.
        Reads no payload: the server calls it on the header alone."""
        expected = self.parts(shape)
        if len(layouts) != len(expected):
            raise CodecError(
                "bad_parts",
                f"codec {self.name} encodes shape {tuple(shape)} as {len(expected)} tensors "
                f"({', '.join(repr(p.suffix) for p in expected)}), got {len(layouts)}",
            )
        for part, (dtype, got) in zip(expected, layouts, strict=True):
            where = f"part {part.suffix!r} of a {self.name}-encoded {tuple(shape)} tensor"
            if dtype != part.dtype:
                raise CodecError("bad_dtype", f"{where} must be {part.dtype}, got {dtype}")
            if tuple(got) != part.shape:
                raise CodecError(
                    "bad_shape", f"{where} must have shape {part.shape}, got {tuple(got)}"
                )

    def check_part(self, shape: Sequence[int], index: int, t: torch.Tensor) -> None:
        """Raise ``CodecError("non_finite" | "bad_scale", ...)`` if part ``index`` of an encoded
        ``shape`` holds values that could decode to NaN or an infinity. Only the parts that can
        (scales, factors, a plain tensor) are read; codes never can, so a receiver can check a
        body's small parts as they land, before its codes are accumulated. Assumes the layout
        was checked."""

    def check(self, parts: Sequence[torch.Tensor], shape: Sequence[int]) -> None:
        """``check_layout`` on the parts' dtypes and shapes, then ``check_part`` on each."""
        self.check_layout(shape, [(p.dtype, tuple(p.shape)) for p in parts])
        for i, t in enumerate(parts):
            self.check_part(shape, i, t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """State that must survive a worker's rejoin (empty for stateless codecs)."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` returned."""
        if state:
            raise ValueError(f"codec {self.name} keeps no state, got {sorted(state)[:3]}")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.options().items()))))
