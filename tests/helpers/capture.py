"""Uploads as a worker streams them: a ``CaptureClient`` keeps each body, the true
pseudo-gradient ``snapshot - local`` when it was sent, and the server's answer, so a test can
decode what the server counted (tests/integration/test_worker_codecs.py, test_outer_rule.py)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from diloco import DiLoCoWorker
from diloco.core.codecs import codec_from_metadata, decode_named
from diloco.wire import iter_body
from diloco.worker.transport.client import DiLoCoClient


@dataclass
class Captured:
    body: bytes
    true: dict[str, torch.Tensor]  # snapshot - local when the body was sent (plain mode)
    fragment: int | None = None
    reply: dict[str, Any] | None = None  # None: the upload raised

    @property
    def metadata(self) -> dict[str, str]:
        (n,) = struct.unpack("<Q", self.body[:8])
        return dict(json.loads(self.body[8 : 8 + n])["__metadata__"])

    @property
    def names(self) -> list[str]:
        """Tensor names in payload order."""
        (n,) = struct.unpack("<Q", self.body[:8])
        header = json.loads(self.body[8 : 8 + n])
        header.pop("__metadata__")
        return sorted(header, key=lambda k: header[k]["data_offsets"][0])

    def decoded(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        tensors = safetensors.torch.load(self.body)
        return decode_named(codec_from_metadata(self.metadata), tensors, shapes)

    @property
    def counted(self) -> bool:
        return self.reply is not None and self.reply.get("status") == "accepted"


class CaptureClient(DiLoCoClient):
    """A client that keeps each upload it sends (the body is produced once more for the copy,
    as a retry would produce it)."""

    def __init__(self, address: str) -> None:
        super().__init__(address, retries=1, backoff=0.01, connect_timeout=2, read_timeout=20)
        self.worker: DiLoCoWorker | None = None
        self.uploads: list[Captured] = []
        self._fragment: int | None = None

    def submit_pseudogradients(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._fragment = kwargs.get("fragment")
        return super().submit_pseudogradients(*args, **kwargs)

    def _post_tensors(self, what: str, path: str, layout: Any, produce: Any, **params: Any) -> Any:
        if path != "/submit_pseudograd":
            return super()._post_tensors(what, path, layout, produce, **params)
        body = b"".join(bytes(c) for c in iter_body(layout, produce))
        assert self.worker is not None
        local = self.worker._local
        if self._fragment is None:
            true = {n: local.snapshot[n] - p.detach().float() for n, p in local.params.items()}
        else:  # the fragment's pseudo-gradient waits in the send buffer (fp32 for a codec)
            views = self.worker._strategy._send_views[self._fragment]  # type: ignore[attr-defined]
            true = {n: v.clone() for n, v in views.items()}
        got = Captured(body, true, self._fragment)
        self.uploads.append(got)
        got.reply = super()._post_tensors(what, path, layout, produce, **params)
        return got.reply
