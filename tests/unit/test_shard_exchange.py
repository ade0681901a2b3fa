"""``allreduce.shard_exchange.layout_free_hash``: the state hash put together from the owners'
CRCs of their runs equals ``collective.state_hash`` of the whole tensors, and only parameters
whose owned boxes are not runs are gathered."""

from __future__ import annotations

import zlib

import torch

from diloco.core.shards import Box
from diloco.wire.encode import byte_view
from diloco.worker.allreduce.collective import state_hash
from diloco.worker.allreduce.shard_exchange import layout_free_hash


class FakeRanks:
    """Two owners of each parameter, holding the boxes given; ``runs`` as every rank's
    ``x_runs`` would answer, ``load`` counts what is gathered."""

    def __init__(self, state: dict[str, dict[str, torch.Tensor]], boxes: dict[str, list[Box]]):
        self.state = state
        self.boxes = boxes
        self.loaded: list[tuple[str, str]] = []

    def runs(self, kind: str) -> dict[str, list[tuple[int, int, int]]]:
        got: dict[str, list[tuple[int, int, int]]] = {}
        for name, boxes in self.boxes.items():
            whole = self.state[kind][name]
            for box in reversed(boxes):  # any order: rank 0 sorts them
                run = box.flat_range(whole.shape)
                if run is not None and box.numel:
                    part = box.read(whole).contiguous()
                    got.setdefault(name, []).append((*run, zlib.crc32(byte_view(part))))
        return got

    def load(self, kind: str, name: str) -> torch.Tensor:
        self.loaded.append((kind, name))
        return self.state[kind][name]


def _state() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, list[Box]]]:
    g = torch.Generator().manual_seed(3)
    shapes = {"rows": (5, 3), "cols": (4, 6), "scalar": (), "one_row": (1, 7)}
    state = {
        kind: {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        for kind in ("snap", "mom")
    }
    boxes = {
        "rows": [Box((0, 0), (3, 3)), Box((3, 0), (2, 3))],  # 3 + 2 rows: runs
        "cols": [Box((0, 0), (4, 3)), Box((0, 3), (4, 3))],  # columns: gathered
        "scalar": [Box((), ())],
        "one_row": [Box((0, 0), (1, 7)), Box((1, 0), (0, 7))],  # 1 + 0 rows: an empty box
    }
    return state, boxes


def test_the_hash_from_runs_is_the_whole_state_hash() -> None:
    state, boxes = _state()
    ranks = FakeRanks(state, boxes)
    entries = [
        (kind, n, tuple(t.shape)) for kind in ("snap", "mom") for n, t in state[kind].items()
    ]
    whole = [state[kind][n] for kind, n, _ in entries]
    assert layout_free_hash(ranks, ranks.load, entries) == state_hash(whole)
    assert ranks.loaded == [("snap", "cols"), ("mom", "cols")]  # only the columns gathered


def test_a_changed_element_in_one_run_changes_the_hash() -> None:
    state, boxes = _state()
    entries = [("snap", n, tuple(t.shape)) for n, t in state["snap"].items()]
    before = layout_free_hash(FakeRanks(state, boxes), lambda k, n: state[k][n], entries)
    state["snap"]["rows"][4, 2] += 1.0  # the second owner's run
    ranks = FakeRanks(state, boxes)
    after = layout_free_hash(ranks, ranks.load, entries)
    assert after != before
    assert after == state_hash([state["snap"][n] for _, n, _ in entries])


def test_runs_that_leave_a_hole_fall_back_to_the_gathered_parameter() -> None:
    state, boxes = _state()
    boxes["rows"] = [Box((0, 0), (3, 3))]  # the owner of the last two rows did not report
    ranks = FakeRanks(state, boxes)
    entries = [("snap", "rows", (5, 3))]
    assert layout_free_hash(ranks, ranks.load, entries) == state_hash([state["snap"]["rows"]])
    assert ranks.loaded == [("snap", "rows")]

