"""What crosses a stage boundary: activations forward, their gradients backward.

A boundary ``b`` sits between stage ``b`` and stage ``b + 1``. Each direction has its own
``BoundaryCodec``: ``fp32``, ``bf16``, ``int8`` (the default) or ``int4`` from
``diloco.core.codecs``, or a model's own ``Compressor``. No error feedback: an activation is used
once, never accumulated, so a residual would have nothing to correct.

A tensor of shape ``[batch, *tail]`` travels as ONE safetensors body (``diloco.wire``): its codec
parts under the name ``"x"`` (``"x@scale"``, ``"x"``), plus plain extra tensors (the tail's
``targets``, the ``loss``), and the decoded shape and the boundary in ``__metadata__``. The
quantizers get one scale per row of the last dimension when that dimension is a power of two
(``block = hidden``): a token's activations share a range, and int8 then costs exactly
``hidden + 2`` bytes per token (codes, one bf16 scale).

``BoundarySpec`` is what a receiver insists on before decoding: the trailing shape and dtype. A
body that does not fit is a ``ValueError`` naming the boundary, the expected and the got shape.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from diloco.core.codecs import Codec, CodecError, codec_by_name, from_wire, to_wire
from diloco.wire import WireError, decode, encode

NAME = "x"
"""Wire name of the boundary tensor's parts in a body."""
MAX_DIMS = 8
BOUNDARY_CODECS = ("fp32", "bf16", "int8", "int4")


class Compressor(Protocol):
    """A model's own compression of a boundary tensor (a subspace-constrained model's
    projection, say). ``decode(encode(t))`` has ``t``'s shape; the parts' names must not
    contain ``"@"`` nor collide with the body's extras."""

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


@dataclass(frozen=True)
class BoundarySpec:
    """The shape a boundary's tensor must have past its leading (batch) dimension."""

    name: str
    """The boundary in messages: ``"0->1"`` for the one between stages 0 and 1."""
    tail: tuple[int, ...]
    """Trailing shape (``(seq, hidden)``); the leading dimension is the micro-batch."""
    dtype: torch.dtype = torch.float32
    """The dtype decoded tensors have (codecs decode to fp32)."""

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """A ``ValueError`` naming the boundary unless ``shape`` is ``[n, *tail]``, ``n >= 1``."""
        if len(shape) != len(self.tail) + 1 or tuple(shape[1:]) != self.tail or shape[0] < 1:
            raise ValueError(
                f"boundary {self.name}: expected shape [batch, {', '.join(map(str, self.tail))}]"
                f" ({self.dtype}), got {list(shape)}"
            )

    def check(self, t: torch.Tensor) -> None:
        self.check_shape(tuple(t.shape))
        if t.dtype != self.dtype:
            raise ValueError(f"boundary {self.name}: expected {self.dtype}, got {t.dtype}")


def row_block(codec: str, last: int) -> int | None:
    """The quantizers' block for rows of ``last`` elements: one scale per row when ``last`` is a
    power of two the codecs accept, else their default (blocks may then straddle rows)."""
    if codec not in ("int8", "int4"):
        return None
    return last if 2 <= last <= 4096 and last & (last - 1) == 0 else None


@dataclass
class BoundaryCodec:
    """One boundary, one direction: encodes a tensor into a body and decodes it back.

    Stateless apart from its own settings: one instance may serve several threads."""

    spec: BoundarySpec
    codec: str = "int8"
    """``fp32``, ``bf16``, ``int8`` or ``int4`` (ignored when ``compressor`` is given)."""
    compressor: Compressor | None = None
    """A model's own compression instead of ``codec``."""
    _core: Codec | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.compressor is not None:
            return
        if self.codec not in BOUNDARY_CODECS:
            raise ValueError(
                f"boundary {self.spec.name}: codec {self.codec!r} is not one of "
                f"{', '.join(BOUNDARY_CODECS)}"
            )
        last = self.spec.tail[-1] if self.spec.tail else 1
        block = row_block(self.codec, last)
        self._core = codec_by_name(self.codec, **({} if block is None else {"block": block}))

    @property
    def label(self) -> str:
        return "custom" if self.compressor is not None else self.codec

    def encode(self, t: torch.Tensor, extras: Mapping[str, torch.Tensor] | None = None) -> bytes:
        """The body of ``t`` (checked against the spec) and plain ``extras``."""
        self.spec.check_shape(tuple(t.shape))
        t = t.detach().float().contiguous()
        if self.compressor is not None:
            tensors = dict(self.compressor.encode(t))
        else:
            assert self._core is not None
            tensors = to_wire(NAME, self._core, t.shape, self._core.encode(t, NAME))
        for key, value in (extras or {}).items():
            if key in tensors:
                raise ValueError(f"extra tensor {key!r} collides with a codec part")
            tensors[key] = value.detach().contiguous()
        meta = {"boundary": self.spec.name, "codec": self.label, "shape": json.dumps(list(t.shape))}
        return encode({k: v.contiguous() for k, v in tensors.items()}, meta)

    def decode(
        self, body: bytes, extras: tuple[str, ...] = ()
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(tensor, {extra: tensor})`` of a body; a ``ValueError`` naming the boundary when the
        body is malformed, another codec's, or the wrong shape. Nothing is decoded before the
        declared shape has been checked against the spec."""
        where = f"boundary {self.spec.name}"
        try:
            layout, tensors = decode(body)
        except WireError as exc:
            raise ValueError(f"{where}: malformed body: {exc}") from None
        meta = layout.metadata or {}
        if meta.get("codec") != self.label:
            raise ValueError(f"{where}: expected codec {self.label}, got {meta.get('codec')!r}")
        shape = _shape_of(meta.get("shape"), where)
        self.spec.check_shape(shape)
        missing = [e for e in extras if e not in tensors]
        if missing:
            raise ValueError(f"{where}: the body lacks {', '.join(missing)}")
        got_extras = {e: tensors.pop(e) for e in extras}
        if self.compressor is not None:
            t = self.compressor.decode(tensors)
        else:
            assert self._core is not None
            try:
                parts = from_wire(tensors, NAME, shape, self._core)
            except CodecError as exc:
                raise ValueError(f"{where}: {exc.detail}") from None
            extra_names = set(tensors) - {NAME + p.suffix for p in self._core.parts(shape)}
            if extra_names:
                raise ValueError(f"{where}: unexpected tensors {sorted(extra_names)[:3]}")
            t = self._core.decode(parts, shape)
        self.spec.check(t)
        return t, got_extras


def _shape_of(raw: str | None, where: str) -> tuple[int, ...]:
    try:
        shape = json.loads(raw) if raw is not None else None
    except ValueError:
        shape = None
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ValueError(f"{where}: the body's metadata has no valid shape ({raw!r})")
    return tuple(shape)


def tokens_of(shape: tuple[int, ...], token_dims: int) -> int:
    """Tokens in a tensor of ``shape``: the product of its first ``token_dims`` dimensions."""
    n = 1
    for d in shape[:token_dims]:
        n *= d
    return n


@dataclass
class Traffic:
    """Bytes and tokens that crossed boundaries, per ``(boundary, direction)``; the
    owner guards it with its own lock."""

    bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    tokens: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, boundary: str, direction: str, nbytes: int, tokens: int) -> None:
        key = (boundary, direction)
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.tokens[key] = self.tokens.get(key, 0) + tokens

    def per_token(self, boundary: str, direction: str) -> float:
        key = (boundary, direction)
        return self.bytes.get(key, 0) / max(1, self.tokens.get(key, 0))

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            f"{b}:{d}": {
                "bytes": self.bytes[(b, d)],
                "tokens": self.tokens[(b, d)],
                "bytes_per_token": self.per_token(b, d),
            }
            for b, d in sorted(self.bytes)
        }


class Meter:
    """What one party (a driver, a stage replica) moved across boundaries: everything it read
    and wrote (``traffic``), and what it sent alone (``sent``: the coordinator sums those, so a
    byte counts once over the peers). Thread-safe."""

    def __init__(self, token_dims: int) -> None:
        self.token_dims = token_dims
        self._lock = threading.Lock()
        self._traffic = Traffic()
        self._sent = Traffic()

    def count(
        self, codec: BoundaryCodec, direction: str, n: int, shape: Any, *, sent: bool = False
    ) -> None:
        """``n`` bytes of a tensor of ``shape`` crossed ``codec``'s boundary in ``direction``."""
        tokens = tokens_of(tuple(shape), self.token_dims)
        with self._lock:
            self._traffic.add(codec.spec.name, direction, n, tokens)
            if sent:
                self._sent.add(codec.spec.name, direction, n, tokens)

    def encode(
        self,
        codec: BoundaryCodec,
        direction: str,
        t: torch.Tensor,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> bytes:
        """``codec.encode`` of a body this party sends, counted."""
        body = codec.encode(t, extras)
        self.count(codec, direction, len(body), t.shape, sent=True)
        return body

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{"traffic": ..., "sent": ...}``, each ``Traffic.snapshot``."""
        with self._lock:
            return {"traffic": self._traffic.snapshot(), "sent": self._sent.snapshot()}
