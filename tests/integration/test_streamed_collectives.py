"""``allreduce/streamed.py`` against the whole-model collectives, in one quorum (gloo in two
threads, the rendezvous served in-process): a member reaching its state one parameter at a
time through ``Parts`` (a sharded group's rank 0) and a plain member run the same collectives
on the same bytes, with parameters split across small buckets, and end bit-identical."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from diloco.core.robust import global_norm
from diloco.worker.allreduce import streamed
from diloco.worker.allreduce.average_checks import checked_average
from diloco.worker.allreduce.collective import QuorumCollective, broadcast, state_hash
from diloco.worker.allreduce.streamed import Entry
from tests.helpers.rendezvous_host import RendezvousHost
from tests.helpers.threads import in_threads

SHAPES = [(7, 5), (0,), (33,), (4, 4, 2), (1,)]
NAMES = [f"p{i}" for i in range(len(SHAPES))]
BUCKET = 64  # bytes: 16 fp32 elements, so most parameters span buckets
_ids = itertools.count()


class DictParts:
    """``streamed.Parts`` over whole tensors by kind: what a sharded group's commands give
    rank 0 (a load is a copy, valid until the next one)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.t = {
            kind: {n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES, strict=True)}
            for kind in ("grad", "snap", "mom", "acc")
        }

    def own(self) -> None:
        pass

    def measure(self) -> tuple[bool, float]:
        return True, global_norm(list(self.t["grad"].values()))

    def load(self, kind: str, name: str) -> torch.Tensor:
        return self.t[kind][name].clone()

    def store(self, kind: str, name: str, whole: torch.Tensor) -> None:
        self.t[kind][name].copy_(whole)

    def step(self, lr: float, momentum: float, nesterov: bool) -> None:
        pass


def _entries(*kinds: str) -> list[Entry]:
    return [(k, n, s) for k in kinds for n, s in zip(NAMES, SHAPES, strict=True)]


def _pair(run0: object, run1: object) -> list[object]:
    quorum_id = f"streamed-{next(_ids)}"
    with RendezvousHost(timeout=10.0) as host:

        def member(rank: int) -> object:
            with QuorumCollective.build(host.meeting(rank), quorum_id, rank, 2, 10.0) as q:
                return (run0 if rank == 0 else run1)(q)  # type: ignore[operator]

        return in_threads(2, member, timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_average_is_the_whole_model_average(dtype: torch.dtype) -> None:
    plain = DictParts(1)
    tensors = list(plain.t["grad"].values())
    parts = DictParts(2)

    def run0(q: QuorumCollective) -> object:
        return checked_average(q, tensors, 1.0, dtype, norm_bound=math.inf, bucket_bytes=BUCKET)

    def run1(q: QuorumCollective) -> object:
        return streamed.checked_average(
            q,
            parts,
            _entries("grad"),
            3.0,
            dtype,
            norm_bound=math.inf,
            sample=3,
            bucket_bytes=BUCKET,
        )

    got0, (got1, samples) = _pair(run0, run1)
    for name, t in zip(NAMES, tensors, strict=True):
        assert torch.equal(parts.t["acc"][name], t), name  # the plain member's bytes
    assert got0.sound and got1.sound and got0.total == got1.total == 4.0
    assert got1.norm == pytest.approx(got0.norm, rel=1e-6)
    assert state_hash(samples) == state_hash([t.reshape(-1)[::3] for t in tensors])


@pytest.mark.parametrize("sender", [0, 1], ids=["plain-sends", "streamed-sends"])
def test_streamed_broadcast_and_hash_are_the_whole_state_s(sender: int) -> None:
    plain = DictParts(3)
    tensors = [*plain.t["snap"].values(), *plain.t["mom"].values()]
    parts = DictParts(4)
    entries = _entries("snap", "mom")

    def run0(q: QuorumCollective) -> None:
        broadcast(q, tensors, sender, bucket_bytes=BUCKET)

    def run1(q: QuorumCollective) -> None:
        streamed.broadcast(q, parts, entries, sender, bucket_bytes=BUCKET)

    _pair(run0, run1)
    for kind in ("snap", "mom"):
        for name in NAMES:
            assert torch.equal(parts.t[kind][name], plain.t[kind][name]), (kind, name)
    assert streamed.streamed_hash(parts, entries) == state_hash(tensors)
