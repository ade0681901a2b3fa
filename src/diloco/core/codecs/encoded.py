"""One encoded tensor as a value: its codec, its wire parts and the shape they stand for.

The server receives a body's parts into an upload buffer and hands each tensor of the body to
``core.accumulate.WeightedSum.add`` as an ``Encoded``; the sum calls ``add_into``, which decodes a
chunk at a time into the fp32 accumulator (``Codec.add_into``), so no full-size decoded copy of an
upload ever exists. ``decode`` is for the few places that must hold the fp32 tensor (robust
aggregation keeps each upload whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.core.codecs.base import Codec, numel_of
from diloco.core.workspace import Workspace


@dataclass(frozen=True, eq=False)
class Encoded:
    """``codec``'s parts of a tensor of ``shape``, in the order of ``codec.parts(shape)``."""

    codec: Codec
    parts: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, codec: Codec, parts: Sequence[torch.Tensor], shape: Sequence[int]) -> Encoded:
        return cls(codec, tuple(parts), tuple(int(d) for d in shape))

    @property
    def numel(self) -> int:
        """Elements of the tensor the parts stand for (not of the parts)."""
        return numel_of(self.shape)

    def add_into(
        self,
        acc: torch.Tensor,
        weight: float = 1.0,
        *,
        first: bool = False,
        work: Workspace | None = None,
    ) -> None:
        """``acc += weight * decoded`` (``acc = ...`` when ``first``), chunk by chunk with no
        full-size temporary: ``Codec.add_into`` (``work``: reused scratch). ``acc`` has
        ``shape`` (or is its flat view)."""
        self.codec.add_into(acc, self.parts, weight, first=first, work=work)

    def check(self) -> None:
        """``Codec.check`` on the parts: a ``CodecError`` for a wrong layout or for values that
        could decode to NaN or an infinity."""
        self.codec.check(self.parts, self.shape)

    def decode(self) -> torch.Tensor:
        """The fp32 tensor (a full-size allocation: not for the server's running sums)."""
        return self.codec.decode(self.parts, self.shape)
