"""The async admission gate's rules, and units: fragment pieces are views of exactly the bytes a
fragment download streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diloco.core import default_outer_optimizer
from diloco.server.params.store import ParamStore
from diloco.server.rounds.async_gate import AsyncGate
from diloco.server.rounds.barrier import Verdict
from diloco.server.rounds.units import Unit, plan_pieces


def test_gate_accepts_and_measures_staleness() -> None:
    gate = AsyncGate(version=3)
    check = gate.check("a", 1, "s1")
    assert (check.verdict, check.staleness) == (Verdict.ACCEPT, 2)
    gate.begin_upload("a", "s1")
    assert gate.check("a", 3, "s2").verdict is Verdict.IN_PROGRESS
    assert gate.record("a", "s1") == 3
    gate.advance()
    assert gate.version == 4 and gate.uploading == {}
    dup = gate.check("a", 1, "s1")
    assert (dup.verdict, dup.counted_in) == (Verdict.DUPLICATE, 3)
    assert gate.check("b", 5, "s3").verdict is Verdict.FUTURE


def test_gate_max_staleness_counts_updates_made_during_the_upload() -> None:
    gate = AsyncGate(version=0, max_staleness=1)
    assert gate.check("a", 0, "s1").verdict is Verdict.ACCEPT
    gate.begin_upload("a", "s1")
    gate.advance()  # two updates by other workers while a's body is on the wire
    gate.advance()
    assert gate.too_stale(0) and gate.staleness_now(0) == 2
    gate.abort_upload("a", "s1")
    assert gate.check("a", 0, "s1").verdict is Verdict.TOO_STALE
    assert gate.check("a", 1, "s2").verdict is Verdict.ACCEPT


def test_gate_forgets_uploads_of_workers_that_leave() -> None:
    gate = AsyncGate()
    gate.begin_upload("a", "s1")
    gate.on_leave("a")
    assert gate.check("a", 0, "s2").verdict is Verdict.ACCEPT
    with pytest.raises(ValueError):
        AsyncGate(max_staleness=-1)


def _store() -> ParamStore:
    return ParamStore.from_tensors(
        {"emb": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.arange(5.0) + 100}
    )


@pytest.mark.parametrize("pattern", ["sequential", "strided"])
def test_pieces_cover_every_element_once(pattern: str) -> None:
    store = _store()
    plans = plan_pieces(store, 3, pattern)
    seen: dict[str, list[int]] = {"emb": [], "b": []}
    for pieces in plans:
        for p in pieces:
            assert p.wire_name == f"{p.param}[{p.start}:{p.stop}]" and p.shape == (p.numel,)
            seen[p.param].extend(range(p.start, p.stop))
    assert sorted(seen["emb"]) == list(range(12)) and sorted(seen["b"]) == list(range(5))
    assert [sum(p.numel for p in f) for f in plans] in ([6, 5, 6], [5, 6, 6], [6, 6, 5])


def test_one_fragment_keeps_names_and_shapes() -> None:
    (pieces,) = plan_pieces(_store(), 1, "sequential")
    assert {(p.wire_name, p.shape) for p in pieces} == {("emb", (3, 4)), ("b", (5,))}


def test_unit_params_view_the_bytes_its_downloads_stream() -> None:
    async def scenario() -> None:
        store = _store()
        plans = plan_pieces(store, 2, "sequential")
        units = [
            Unit(
                i,
                pieces,
                store,
                lambda ps: default_outer_optimizer(ps, 1.0, 0.0),
                round=0,
            )
            for i, pieces in enumerate(plans)
        ]
        store.on_new_buffer = lambda: [u.repoint() for u in units]
        reader = await store.open_snapshot()  # forces the next update to copy on write
        unit = units[1]

        def step(progress: object) -> None:
            for p in unit.params:
                p.data.add_(1000.0)

        await store.update(step)
        store.close_snapshot(reader)
        assert store.copies_on_write == 1
        snap = await store.open_parts(lambda: unit.header("x"), unit.ranges, 1)
        streamed = torch.cat(
            [torch.frombuffer(bytearray(part), dtype=torch.float32) for part in snap.body_parts]
        )
        original = {"emb": torch.arange(12, dtype=torch.float32), "b": torch.arange(5.0) + 100}
        # Only fragment 1's elements moved (in the fresh buffer), and its download streams them.
        want = torch.cat([original[p.param][p.start : p.stop] + 1000.0 for p in plans[1]])
        assert torch.equal(streamed, want)
        now = {n: t.reshape(-1) for n, t in store.named().items()}
        for p in plans[0]:
            assert torch.equal(now[p.param][p.start : p.stop], original[p.param][p.start : p.stop])
        for p in plans[1]:
            assert torch.equal(
                now[p.param][p.start : p.stop], original[p.param][p.start : p.stop] + 1000
            )
        store.close_snapshot(snap)

    asyncio.run(scenario())
