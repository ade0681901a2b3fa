"""A lossy codec in a sharded worker group: the error-feedback residual on the shards
(docs/design/groups.md, "Sharded groups"; docs/design/codecs.md, "Worker side").

Each rank keeps the residual of the boxes it *owns* (``ShardState.residual``: fp32, CPU, pinned
for CUDA parameters, made at the first commit); replicas along a ``Replicate`` dim keep none, so
every element's residual is kept once. No rank holds the model's residual.

Rank 0 encodes one parameter at a time exactly as a single process encodes the whole parameter
(``UploadEncoder``'s arithmetic, not a copy of it):

- **encode** (the upload reaches the parameter): ``grad NAME owed`` gathers
  ``c = (snapshot - local) + decay * e`` in fp32 from the owners; a block codec encodes it
  from the parameter's first element (``encode_flat``), low rank encodes the whole matrix
  (``codec.encode``; its factors kept for the upload's lifetime, as ``_ModelBody`` keeps them:
  a retry sends the same ones, and the commit subtracts them);
- **commit** (only once the server counted the body): ``c`` is gathered again (the shards do
  not move during a sync, so the same bits), rank 0 computes ``e = c - decode(encode(c))`` for
  that one parameter in a staging buffer (``commit_flat``; low rank: ``ErrorFeedback.commit``
  with the upload's factors) and the ``owe NAME`` command scatters each owner its box.

So a refused, cut or unanswered upload leaves every rank's residual as it was. Rank 0's extra
memory is its staging (the gathered ``c``, the new residual, the encoded parts: each at most the
largest parameter) and low rank's factors. ``residual_norm`` is the whole residual's norm, read
on rank 0 from each parameter's new residual, which it holds whole for a moment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from diloco.core.codecs import ErrorFeedback
from diloco.core.shards import Box
from diloco.worker.groups.json_collectives import all_gather_json
from diloco.worker.groups.sharded import ShardState
from diloco.worker.state.encoder import RESIDUAL, Body, Upload, UploadEncoder

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")


class ResidualShards:
    """Every rank's side of the ``owe`` command; rank 0's body (``UploadEncoder.model_body``)."""

    def __init__(self, state: ShardState) -> None:
        self._st = state
        state.handlers["owe"] = self._owe

    # --- rank 0 -----------------------------------------------------------------------------

    def upload(self, enc: UploadEncoder) -> Upload:
        """Rank 0: the whole model's lossy body, encoded from the shards."""
        return _ShardedBody(enc, self._st).upload()

    # --- every rank -------------------------------------------------------------------------

    @torch.no_grad()
    def _owe(self, cmd: dict[str, Any]) -> None:
        """Rank 0's new residual of one parameter (its ``resid`` staging) to every owner."""
        st = self._st
        plan = st.plans[cmd["name"]]
        whole = resid_staging(st, plan.name, plan.shape) if st.rank == 0 else None
        st.scatter(plan, whole, self._keep)

    def _keep(self, name: str, values: torch.Tensor, owns: bool) -> None:
        if not owns:
            return  # a replica: the owner keeps this box's residual
        st = self._st
        e = st.residual.get(name)
        if e is None:
            held = st.plans[name].boxes[st.rank]
            assert held is not None
            e = torch.zeros(held[0].shape, dtype=torch.float32, pin_memory=st.device.type == "cuda")
            st.residual[name] = e
        e.view(-1).copy_(values)

    # --- checkpoints (every rank) -----------------------------------------------------------

    def saved(self) -> dict[str, torch.Tensor]:
        """This rank's residual boxes, keyed ``RESIDUAL + name``, for its snapshot file."""
        return {RESIDUAL + n: e.detach().to("cpu", copy=True) for n, e in self._st.residual.items()}

    def kept(self) -> list[bool]:
        """Every rank (a collective): whether each rank keeps a residual."""
        st = self._st
        return [bool(k) for k in all_gather_json(bool(st.residual), st.pg, device=st.device)]

    def restore(
        self,
        read: Mapping[str, torch.Tensor] | None,
        enc: UploadEncoder,
    ) -> None:
        """Every rank (a collective): take this rank's owned residual boxes from ``read``
        (name -> this rank's owned box, already cut; None: the checkpoint has none), and give
        rank 0's encoder the whole residual's squared norm per parameter. Without error
        feedback the residual is dropped with a warning."""
        st = self._st
        st.residual.clear()
        if read and enc.feedback is None:
            log.warning("codec %s keeps no residual here: the checkpoint's is dropped", enc.codec)
            read = None
        pin = st.device.type == "cuda"
        squares: dict[str, float] = {}
        for name, e in (read or {}).items():
            kept = torch.empty(e.shape, dtype=torch.float32, pin_memory=pin)
            st.residual[name] = kept.copy_(e)
            squares[name] = float(torch.linalg.vector_norm(kept)) ** 2
        every = all_gather_json(squares, st.pg, device=st.device)
        if st.rank == 0 and enc.feedback is not None:
            total: dict[str, float] = {}
            for got in every:
                for name, sq in got.items():
                    total[name] = total.get(name, 0.0) + sq
            with enc.lock:
                enc.committed(total)


def owned_box(state: ShardState, name: str) -> Box | None:
    """The box of parameter ``name`` this rank owns (keeps the residual of); None if none."""
    held = state.plans[name].boxes[state.rank]
    return held[0] if held is not None and held[1] else None


def resid_staging(state: ShardState, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's buffer of one parameter's new residual (fp32, CPU), reused across parameters."""
    n = 1
    for d in shape:
        n *= d
    return state.staging.get("resid", n, torch.float32, cpu=True).view(shape)


class _ShardedBody(Body):
    """The whole model, one parameter at a time, ``c`` gathered from the owners."""

    def __init__(self, enc: UploadEncoder, state: ShardState) -> None:
        self.state = state
        self.shapes = {n: plan.shape for n, plan in state.plans.items()}  # the model's order
        super().__init__(enc, enc.codec, self.shapes)
        self.factors: dict[str, list[torch.Tensor]] = {}  # low rank's, for the upload's life

    def _c(self, name: str) -> torch.Tensor:
        """``(snapshot - local) + e`` of parameter ``name``, whole, fp32, on rank 0's CPU (a
        staging buffer, valid until the next command); ``e`` absent before the first commit and
        without error feedback."""
        owed = self.enc.feedback is not None
        cmd = {"cmd": "grad", "name": name, "dtype": "F32", "owed": owed, "decay": self.enc.decay}
        got = self.state.command(cmd)
        assert got is not None
        return got

    def encode(self, key: str) -> list[torch.Tensor]:
        enc, shape = self.enc, self.shapes[key]
        block = enc.block_of(shape)
        if block is None:
            if key not in self.factors:
                c = self._c(key)
                self.factors[key] = [t.to("cpu", copy=True) for t in enc.codec.encode(c, key)]
            return self.factors[key]
        c = self._c(key).reshape(-1)
        host = enc.parts_buffer("host", block, c.numel(), _CPU)
        enc.encode_flat(block, None, c, host, _CPU)  # c already holds e: nothing to add
        return [h.view(part.shape) for h, part in zip(host, enc.codec.parts(shape), strict=True)]

    def commit(self) -> None:
        enc = self.enc
        squares = {}
        with enc.lock:
            for name, shape in self.shapes.items():
                c = self._c(name)
                e = resid_staging(self.state, name, shape)
                e.zero_()
                block = enc.block_of(shape)
                if block is None:  # e = c - P Q^T with the factors sent
                    feedback = ErrorFeedback()
                    feedback.residuals[name] = e
                    feedback.commit(enc.codec, name, c, self.factors[name])
                    squares[name] = float(torch.linalg.vector_norm(e)) ** 2
                else:  # e = 0 + c, encoded, what was sent subtracted: commit_flat's arithmetic
                    squares[name] = enc.commit_flat(block, e.view(-1), c.reshape(-1))
                self.state.command({"cmd": "owe", "name": name})
            enc.committed(squares)
