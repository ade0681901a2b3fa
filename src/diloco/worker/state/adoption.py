"""Adopting downloaded global parameters while the download is still arriving.

After a counted upload the model is replaced by the new global parameters. Done after the
download, that is one more pass over the whole model (400 MB for a 100M model) at the very end
of the sync, on every worker at once. Done as the bytes land, each copy reads memory the socket
has just written (still in cache) and overlaps the rest of the transfer, and the sync ends with
the last byte received.

Only adoption goes this way: copying global values into the model is idempotent, so a download
that breaks off and is fetched again simply copies again. A rebase (local progress + global)
must happen exactly once and stays a pass after the end.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.wire.layout import Layout


class StreamedAdoption:
    """Copies each parameter's received part of a download into the model.

    ``snapshot`` holds the views of the download's payload (layout order); ``upto(n)`` says the
    first ``n`` payload bytes have landed. Whole elements are copied as soon as their bytes are
    in; a tensor that cannot be cut into flat pieces (a non-contiguous parameter, a payload
    tensor not on an element boundary) is copied whole once all of its bytes are in."""

    def __init__(
        self,
        layout: Layout,
        snapshot: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> None:
        self._parts: list[tuple[int, int, int, torch.Tensor, torch.Tensor, bool]] = []
        for spec, (begin, end) in zip(layout.specs, layout.offsets, strict=True):
            src, dst = snapshot[spec.name], params[spec.name]
            if src.shape != dst.shape:
                raise ValueError(
                    f"{spec.name!r}: download shape {tuple(src.shape)} != model shape "
                    f"{tuple(dst.shape)}"
                )
            flat = begin % spec.itemsize == 0 and src.is_contiguous() and dst.is_contiguous()
            self._parts.append((begin, end, spec.itemsize, src, dst, flat))
        self._names = [spec.name for spec in layout.specs]
        self._index = 0  # first part not yet copied in full
        self._copied = 0  # elements of that part copied so far

    @property
    def complete(self) -> bool:
        return self._index == len(self._parts)

    @property
    def done(self) -> list[str]:
        """The parameters copied in full so far (layout order)."""
        return self._names[: self._index]

    @torch.no_grad()
    def upto(self, received: int) -> None:
        """Copy what the first ``received`` payload bytes complete (bytes go in order)."""
        while self._index < len(self._parts):
            begin, end, itemsize, src, dst, flat = self._parts[self._index]
            if received >= end:
                if flat and self._copied:
                    a = self._copied
                    dst.view(-1)[a:].copy_(src.view(-1)[a:], non_blocking=True)
                else:
                    dst.copy_(src, non_blocking=True)
                self._index += 1
                self._copied = 0
                continue
            if flat and received > begin:
                whole = (received - begin) // itemsize
                if whole > self._copied:
                    a = self._copied
                    dst.view(-1)[a:whole].copy_(src.view(-1)[a:whole], non_blocking=True)
                    self._copied = whole
            return
