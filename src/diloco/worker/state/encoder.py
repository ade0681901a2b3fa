"""How a worker's pseudo-gradients go on the wire: its codec, and error feedback for a lossy one
(docs/design/codecs.md, "Worker side").

``fp32`` and ``bf16`` are sent as today: ``LocalModel.produce`` streams ``snapshot - local`` from a
reused scratch, with no residual (bf16's rounding is what every release sent). Any other codec
keeps an ``ErrorFeedback`` residual per parameter, on the parameter's device, and its body carries
each tensor's parts together, scales and factors first (``codec.parts`` order).

**The residual moves only when the server counted the body.** An upload encodes ``c = g + e``
(``g`` the pseudo-gradient, ``e`` the residual; ``c = g + decay * e`` with a decay, ``set_decay``:
SparseLoCo's, the product rounded before the sum in both passes) without touching ``e``; once the server answers
that this very body counted, ``commit`` computes ``c`` again (the model has not moved: plain
uploads are synchronous, a fragment's ``g`` waits in its send buffer) and keeps
``e = c - decode(encode(c))``, the same bits, since encoding is deterministic (low-rank factors
are kept from the upload instead: a second power iteration would give others). So a retried
body is the same bytes, and a refused, cut or unanswered upload leaves ``e`` as it was: its
progress stays in the model and goes with the next upload, compensated by the same ``e``.
A whole-model body keeps each parameter's parts for the upload's lifetime: a retry sends them
again and the commit subtracts them instead of encoding ``c`` a second time (the same bits).
Memory: the residual, two pieces of fp32 scratch, the codecs' scratch (a ``Workspace`` per
encoding thread), and the body's encoded parts (a fragment's: one piece's), since scales go out
before codes.

Without error feedback (``error_feedback=False``, to measure what it buys) a lossy codec encodes
each round's ``g`` on its own and keeps no residual: the commit is a no-op. Low rank still keeps
its warm-start ``Q``, which is the codec's state, not feedback.

Streaming fragments are cut at any element, so each fragment piece is encoded as its own flat
tensor (its own blocks, from the piece's first element), compensated by its range of the
parameter's residual: the residual does not depend on the plan.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from diloco.core.codecs import (
    Bf16Codec,
    BlockCodec,
    Codec,
    ErrorFeedback,
    Fp32Codec,
    LowRankCodec,
    Workspace,
    check_name,
    codec_metadata,
)
from diloco.core.fragments import Piece
from diloco.core.pseudo_gradient import PIECE
from diloco.wire import CODE_OF_DTYPE, TensorSpec
from diloco.worker.state.local_model import LocalModel

log = logging.getLogger(__name__)

Produce = Callable[[TensorSpec], "torch.Tensor | Iterable[torch.Tensor]"]
RESIDUAL = "residual/"
"""Key prefix of the residuals in ``state_dict`` (then the parameter's name)."""
CODEC_STATE = "codec/"
"""Key prefix of the codec's own state (low rank's warm-start ``Q``) in ``state_dict``."""
SENT = "sent/"
"""Scratch key prefix of a parameter's kept parts (``_ModelBody.sent``), then its name."""


def comm_dtype(codec: Codec) -> str:
    """The dtype of ``LocalModel``'s pseudo-gradient pieces (and the streaming send buffer):
    bf16 for the bf16 codec, fp32 for every other (a lossy codec encodes from fp32)."""
    return "BF16" if isinstance(codec, Bf16Codec) else "F32"


@dataclass
class Upload:
    """One upload's body: ``specs`` and ``produce`` for ``submit_pseudogradients`` (a retry calls
    ``produce`` again and gets the same bytes), and ``commit``, to call once the server says
    that this body counted."""

    specs: list[TensorSpec]
    produce: Produce
    commit: Callable[[], None]


class UploadEncoder:
    """A worker's codec and residuals. ``commit`` may run on the streaming sender thread while
    the training thread reads ``state_dict`` or ``residual_norm``: those take a lock.
    ``error_feedback`` False: a lossy codec sends each pseudo-gradient encoded on its own."""

    def __init__(
        self,
        codec: Codec,
        local: LocalModel,
        metrics: dict[str, float],
        error_feedback: bool = True,
    ) -> None:
        self.codec = codec
        self.metadata = codec_metadata(codec)
        #: fp32 or bf16: sent as ``LocalModel.produce`` streams it, never encoded here.
        self.raw = isinstance(codec, (Fp32Codec, Bf16Codec))
        #: A lossy codec's residuals; None for a raw codec, or with ``error_feedback`` off.
        self.feedback = None if self.raw or not error_feedback else ErrorFeedback()
        self._local = local
        self._metrics = metrics
        self.lock = threading.Lock()
        #: Set by a sharded group's rank 0: its residual is on the shards (``sharded_codec``).
        self.model_body: Callable[[UploadEncoder], Upload] | None = None
        self._squares: dict[str, float] = {}  # squared residual norm per committed tensor
        self._scratch: dict[tuple[str, torch.device], list[torch.Tensor]] = {}
        self._workspaces = threading.local()  # the codecs' scratch, one per encoding thread

    def check_names(self) -> None:
        """A ``ValueError`` for a parameter name a codec part's name could collide with."""
        if not self.raw:
            for name in self._local.params:
                check_name(name)

    # --- bodies -------------------------------------------------------------------------------

    def model_upload(self) -> Upload:
        """The whole model's ``snapshot - local``, as plain DiLoCo sends it."""
        if self.raw:
            return Upload(self._local.specs(), self._local.produce, nothing)
        if self.model_body is not None:
            return self.model_body(self)
        return _ModelBody(self).upload()

    def fragment_upload(self, pieces: list[Piece], send: Mapping[str, torch.Tensor]) -> Upload:
        """A fragment's pseudo-gradient, already in ``send`` (one flat tensor per piece)."""
        if self.raw:
            dtype = self._local.comm_dtype
            specs = [TensorSpec(p.wire_name, dtype, (p.numel,)) for p in pieces]
            return Upload(specs, lambda spec: send[spec.name], nothing)
        return _FragmentBody(self, pieces, send).upload()

    @property
    def decay(self) -> float:
        """The residual's decay (``ErrorFeedback.decay``; 1 without error feedback)."""
        return 1.0 if self.feedback is None else self.feedback.decay

    def set_decay(self, decay: float) -> None:
        """Scale the residual by ``decay`` (in [0, 1]) before each compensation from the next
        upload on: told at registration (the server's outer rule, or ``ef_decay``). Taken under
        the lock, so a streaming commit runs wholly at one decay."""
        if not (math.isfinite(decay) and 0 <= decay <= 1):
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        with self.lock:
            if self.feedback is not None and self.feedback.decay != decay:
                log.info("error feedback decay %g", decay)
                self.feedback.decay = float(decay)

    # --- what the metrics and a checkpoint see ------------------------------------------------

    def residual_norm(self) -> float:
        """``||e||`` after the last committed upload (0 without error feedback)."""
        with self.lock:
            return math.sqrt(sum(self._squares.values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the residuals and the codec's state, keyed with ``RESIDUAL`` and
        ``CODEC_STATE`` in front of the names: one safetensors file holds them."""
        with self.lock:
            out = {}
            if self.feedback is not None:
                for name, e in self.feedback.residuals.items():
                    out[RESIDUAL + name] = e.detach().to("cpu", copy=True)
            for name, t in self.codec.state_dict().items():
                out[CODEC_STATE + name] = t.detach().to("cpu", copy=True)
            return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore ``state_dict`` (a resumed worker). A ``ValueError`` for residuals that do not
        fit the model; state of another codec is dropped with a warning."""
        residuals = {k[len(RESIDUAL) :]: t for k, t in state.items() if k.startswith(RESIDUAL)}
        own = {k[len(CODEC_STATE) :]: t for k, t in state.items() if k.startswith(CODEC_STATE)}
        params = self._local.params
        for name, e in residuals.items():
            if name not in params or tuple(e.shape) != tuple(params[name].shape):
                raise ValueError(f"the checkpoint's residual {name!r} does not fit the model")
        with self.lock:
            if self.feedback is None:
                if residuals:
                    log.warning(
                        "codec %s%s keeps no residual: the checkpoint's is dropped",
                        self.codec.name,
                        "" if self.raw else " without error feedback",
                    )
            else:
                self.feedback.residuals = {
                    n: e.to(params[n].device, torch.float32, copy=True)
                    for n, e in residuals.items()
                }
                self._squares = {
                    n: float(torch.linalg.vector_norm(e)) ** 2
                    for n, e in self.feedback.residuals.items()
                }
            try:
                self.codec.load_state_dict(own)
            except ValueError as exc:
                log.warning(
                    "the checkpoint's codec state is not for %r, dropped: %s", self.codec, exc
                )
        self._metrics["residual_norm"] = self.residual_norm()

    # --- the arithmetic -----------------------------------------------------------------------

    def block_of(self, shape: tuple[int, ...]) -> BlockCodec | None:
        """The piecewise codec a tensor of ``shape`` goes through; None for a low-rank matrix."""
        codec = self.codec
        if isinstance(codec, LowRankCodec):
            return codec.fallback if codec.matrix_shape(shape) is None else None
        assert isinstance(codec, BlockCodec)
        return codec

    def _buffer(
        self, key: str, sizes: list[tuple[torch.dtype, int]], device: torch.device
    ) -> list[torch.Tensor]:
        """Reused flat buffers of at least ``sizes``; grown, never shrunk."""
        have = self._scratch.get((key, device))
        if have is None or any(t.numel() < n for t, (_, n) in zip(have, sizes, strict=True)):
            pin = device.type == "cpu" and self._local.device.type == "cuda"
            have = [torch.empty(n, dtype=dt, device=device, pin_memory=pin) for dt, n in sizes]
            self._scratch[(key, device)] = have
        return [t[:n] for t, (_, n) in zip(have, sizes, strict=True)]

    def parts_buffer(
        self, key: str, block: BlockCodec, n: int, device: torch.device
    ) -> list[torch.Tensor]:
        return self._buffer(key, [(p.dtype, p.numel) for p in block.flat_parts(n)], device)

    def workspace(self) -> Workspace:
        """The calling thread's reused codec scratch (``Workspace``): a body is encoded in the
        sync or sender thread, committed there or on the sender thread."""
        work: Workspace | None = getattr(self._workspaces, "work", None)
        if work is None:
            work = self._workspaces.work = Workspace()
        return work

    def _fp32(self, key: str, n: int, device: torch.device) -> torch.Tensor:
        return self._buffer(key, [(torch.float32, n)], device)[0]

    def pieces(self, name: str, p: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, stop, g)``: ``snapshot - local`` of parameter ``name`` in flat pieces of
        ``PIECE`` elements, computed in fp32 on the parameter's device into reused scratch."""
        snap = self._local.snapshot[name].reshape(-1)
        local = p.detach().reshape(-1)
        for a in range(0, local.numel(), PIECE):
            b = min(local.numel(), a + PIECE)
            g = self._fp32("g", b - a, local.device)
            if snap.device == local.device:
                torch.sub(snap[a:b], local[a:b], out=g)
            else:  # the snapshot's piece goes to the GPU, not the model's to the CPU
                g.copy_(snap[a:b], non_blocking=True)
                g.sub_(local[a:b])
            yield a, b, g

    def full(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """``snapshot - local`` of a whole parameter in fp32 on its device (low rank needs the
        matrix; one parameter at a time)."""
        g = self._local.snapshot[name].to(p.device, torch.float32, copy=True)
        return g.sub_(p.detach())

    def encode_flat(
        self,
        block: BlockCodec,
        e: torch.Tensor | None,
        g: torch.Tensor,
        out: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        """``out`` (flat CPU parts of ``g.numel()`` elements) = ``block``'s encoding of
        ``decay * e + g`` (``e`` None: zeros), computed on ``device`` (the parameter's, where ``e``
        lives); ``g`` is a piece of a parameter (its start on a block) or a whole fragment
        piece. Neither ``e`` nor ``g`` changes."""
        n = g.numel()
        for a in range(0, n, PIECE):
            b = min(n, a + PIECE)
            c = g[a:b]
            if c.device != device:
                c = self._fp32("g", b - a, device).copy_(c, non_blocking=True)
            if e is not None:
                scratch = self._fp32("c", b - a, device)
                if self.decay == 1.0:
                    c = torch.add(e[a:b], c, out=scratch)
                else:  # the product rounded, then the sum: commit_flat's two steps, same bits
                    c = torch.mul(e[a:b], self.decay, out=scratch).add_(c)
            sub = [o[s:t] for o, (s, t) in zip(out, block.piece_ranges(n, a, b), strict=True)]
            work = self.workspace()
            if c.device == sub[0].device:
                block.encode_piece(c, sub, work)
            else:  # encoded on the GPU, a byte or less per element crosses to the host
                parts = block.encode_piece(c, self.parts_buffer("dev", block, b - a, device), work)
                for o, t in zip(sub, parts, strict=True):
                    o.copy_(t)

    def commit_flat(
        self,
        block: BlockCodec,
        e: torch.Tensor,
        g: torch.Tensor,
        sent: list[torch.Tensor] | None = None,
    ) -> float:
        """``e = c - decode(encode(c))`` with ``c = decay * e + g`` (flat, ``e`` updated in
        place): the
        arithmetic of ``ErrorFeedback.encode_piece``, for a range of a residual that need not
        start on a block. ``sent``: the flat parts ``encode_flat`` wrote for this very ``e`` and
        ``g`` (an upload keeps them), so ``encode(c)`` is not computed a second time: encoding
        is deterministic and ``c`` has the same bits, so the residual has them too. Returns
        ``||e||**2`` of the range, read while it is in cache."""
        n = g.numel()
        total = torch.zeros((), dtype=torch.float32, device=e.device)
        work = self.workspace()
        for a in range(0, n, PIECE):
            b = min(n, a + PIECE)
            gd = g[a:b]
            if gd.device != e.device:
                gd = self._fp32("g", b - a, e.device).copy_(gd, non_blocking=True)
            c = e[a:b]
            if self.decay != 1.0:
                c.mul_(self.decay)
            c.add_(gd)
            if sent is None:
                dev = self.parts_buffer("dev", block, b - a, e.device)
                parts = block.encode_piece(c, dev, work)
            else:
                parts = self._on(e.device, block, b - a, sent, block.piece_ranges(n, a, b))
            block.add_piece_into(c, parts, -1.0, False, work)
            total += torch.linalg.vector_norm(c).square()
        return float(total)

    def _on(
        self,
        device: torch.device,
        block: BlockCodec,
        n: int,
        flat: list[torch.Tensor],
        ranges: list[tuple[int, int]],
    ) -> list[torch.Tensor]:
        """The ``ranges`` of the flat parts ``flat`` on ``device`` (a GPU: copied into reused
        scratch, a byte or less per element)."""
        sub = [f[s:t] for f, (s, t) in zip(flat, ranges, strict=True)]
        if sub[0].device == device:
            return sub
        dev = self.parts_buffer("dev", block, n, device)
        return [d.copy_(t, non_blocking=True) for d, t in zip(dev, sub, strict=True)]

    def owed(self, name: str) -> torch.Tensor | None:
        """The residual of parameter ``name`` as it stands, to read only (it moves at the commit);
        None before its first commit, or without error feedback."""
        return None if self.feedback is None else self.feedback.residuals.get(name)

    def residual(self, name: str) -> torch.Tensor:
        """The residual of parameter ``name`` (zeros at first), on the parameter's device."""
        assert self.feedback is not None
        p = self._local.params[name]
        e = self.feedback.residuals.get(name)
        if e is None or e.shape != p.shape:
            e = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif e.device != p.device:  # the model moved: the residual follows, nothing is lost
            e = e.to(p.device)
        self.feedback.residuals[name] = e
        return e

    def committed(self, squares: Mapping[str, float]) -> None:
        """Note the squared residual norms of the parameters just committed (under the lock)."""
        self._squares.update(squares)
        self._metrics["residual_norm"] = math.sqrt(sum(self._squares.values()))


def nothing() -> None:
    pass


def _ranges(flat: list[torch.Tensor], ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [f[s:t] for f, (s, t) in zip(flat, ranges, strict=True)]


class Body:
    """An upload's body: ``tensors`` (key -> shape on the wire) each as ``codec``'s parts, in
    order; a tensor is encoded (``encode(key)``) when its first part is asked for."""

    def __init__(self, enc: UploadEncoder, codec: Codec, tensors: Mapping[str, tuple[int, ...]]):
        self.enc = enc
        self.where: dict[str, tuple[str, int]] = {}
        self.specs: list[TensorSpec] = []
        for key, shape in tensors.items():
            for i, part in enumerate(codec.parts(shape)):
                self.where[key + part.suffix] = (key, i)
                self.specs.append(
                    TensorSpec(key + part.suffix, CODE_OF_DTYPE[part.dtype], part.shape)
                )
        self.current: tuple[str, list[torch.Tensor]] | None = None

    def upload(self) -> Upload:
        # Without error feedback nothing moves once the server counted the body.
        return Upload(
            self.specs, self.produce, nothing if self.enc.feedback is None else self.commit
        )

    def produce(self, spec: TensorSpec) -> torch.Tensor:
        key, index = self.where[spec.name]
        if index == 0 or self.current is None or self.current[0] != key:
            self.current = (key, self.encode(key))
        return self.current[1][index]

    def encode(self, key: str) -> list[torch.Tensor]:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError


class _ModelBody(Body):
    """The whole model, one parameter at a time."""

    def __init__(self, enc: UploadEncoder) -> None:
        self.params = dict(enc._local.params)
        super().__init__(enc, enc.codec, {n: tuple(p.shape) for n, p in self.params.items()})
        # Low-rank factors, encoded once per upload: a retry must send the same ones, and the
        # commit subtracts them.
        self.factors: dict[str, list[torch.Tensor]] = {}
        # Each parameter's flat parts as sent, kept for the upload's lifetime in buffers reused
        # across rounds (the body's compressed size in all): a retry sends them again and the
        # commit subtracts them, so a counted upload encodes once, not twice (for topk, whose
        # selection is most of a round's CPU, that halves the worker's codec time).
        self.sent: dict[str, list[torch.Tensor]] = {}

    def encode(self, key: str) -> list[torch.Tensor]:
        enc, p = self.enc, self.params[key]
        shape = tuple(p.shape)
        e = enc.owed(key)
        block = enc.block_of(shape)
        if block is None:
            if key not in self.factors:
                c = enc.full(key, p)
                if e is not None:  # as ErrorFeedback.commit: decay * e rounded, then added
                    owed = e.to(c.device)
                    c.add_(owed if enc.decay == 1.0 else owed * enc.decay)
                self.factors[key] = [t.to("cpu").contiguous() for t in enc.codec.encode(c, key)]
            return self.factors[key]
        n = p.numel()
        host = self.sent.get(key)
        if host is None:
            host = enc.parts_buffer(SENT + key, block, n, torch.device("cpu"))
            flat_e = None if e is None else e.to(p.device).view(-1)
            for a, b, g in enc.pieces(key, p):
                ranges = block.piece_ranges(n, a, b)
                sub = [h[s:t] for h, (s, t) in zip(host, ranges, strict=True)]
                enc.encode_flat(block, None if flat_e is None else flat_e[a:b], g, sub, g.device)
            self.sent[key] = host
        return [h.view(part.shape) for h, part in zip(host, enc.codec.parts(shape), strict=True)]

    def commit(self) -> None:
        enc = self.enc
        assert enc.feedback is not None
        squares = {}
        with enc.lock:
            for name, p in self.params.items():
                block = enc.block_of(tuple(p.shape))
                e = enc.residual(name)
                if block is None:
                    g = enc.full(name, p)
                    enc.feedback.commit(
                        enc.codec, name, g, [t.to(g.device) for t in self.factors[name]]
                    )
                    squares[name] = float(torch.linalg.vector_norm(e)) ** 2
                    continue
                flat, sent, n = e.view(-1), self.sent.get(name), p.numel()
                squares[name] = sum(
                    enc.commit_flat(
                        block,
                        flat[a:b],
                        g,
                        None if sent is None else _ranges(sent, block.piece_ranges(n, a, b)),
                    )
                    for a, b, g in enc.pieces(name, p)
                )
            enc.committed(squares)


class _FragmentBody(Body):
    """A fragment's pieces, each encoded as its own flat tensor from the send buffer."""

    def __init__(self, enc: UploadEncoder, pieces: list[Piece], send: Mapping[str, torch.Tensor]):
        assert isinstance(enc.codec, BlockCodec), "streaming takes piecewise codecs only"
        self.block: BlockCodec = enc.codec
        self.pieces = {p.wire_name: p for p in pieces}
        self.send = send
        super().__init__(enc, self.block, {p.wire_name: (p.numel,) for p in pieces})

    def encode(self, key: str) -> list[torch.Tensor]:
        enc, piece = self.enc, self.pieces[key]
        device = enc._local.params[piece.param].device
        e = enc.owed(piece.param)
        own = None if e is None else e.to(device).view(-1)[piece.start : piece.stop]
        host = enc.parts_buffer("host", self.block, piece.numel, torch.device("cpu"))
        enc.encode_flat(self.block, own, self.send[key], host, device)
        return host

    def commit(self) -> None:
        enc = self.enc
        squares = {}
        with enc.lock:
            for wire, piece in self.pieces.items():
                e = enc.residual(piece.param).view(-1)
                sq = enc.commit_flat(self.block, e[piece.start : piece.stop], self.send[wire])
                # Norms are kept per parameter; a piece that is not the whole parameter costs
                # one pass over the rest of it (at most two such pieces per fragment).
                whole = piece.start == 0 and piece.stop == e.numel()
                squares[piece.param] = sq if whole else float(torch.linalg.vector_norm(e)) ** 2
            enc.committed(squares)
