"""Streaming DiLoCo fragments (arXiv 2501.18512): which parameters sync when.

Fragments are balanced by size, not by tensor count: a fragment is a list of flat element
ranges ("spans") of parameters, so one large tensor (an embedding, an output layer) can be shared
between fragments and every fragment holds the same number of elements to within one.

The planner here is the one the server and the worker share: both must cut the model into the
same pieces with the same names, or an upload would not match its unit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SEQUENTIAL = "sequential"
STRIDED = "strided"
PATTERNS = (SEQUENTIAL, STRIDED)  # how a model is cut into fragments (see the split functions)


@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of the flattened parameter ``name``."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """One tensor of a unit's messages: a whole parameter, or elements ``[start, stop)`` of it."""

    wire_name: str
    param: str
    index: int  # position of the parameter in the parameter order the plan was made from
    start: int
    stop: int
    shape: tuple[int, ...]  # the shape on the wire: the parameter's, or (stop - start,)

    @property
    def numel(self) -> int:
        return self.stop - self.start


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan(
    table: Mapping[str, tuple[int, ...]], num_fragments: int, pattern: str
) -> list[list[Piece]]:
    """The pieces of each unit, from the parameters' names and shapes in their order. One
    fragment: the parameters with their own names and shapes (the messages of plain DiLoCo).
    More: flat spans named ``param[start:stop]``, balanced by size."""
    if pattern not in PATTERNS:
        raise ValueError(f"fragment pattern must be one of {PATTERNS}, got {pattern!r}")
    if num_fragments == 1:
        return [
            [
                Piece(name, name, i, 0, numel(shape), tuple(shape))
                for i, (name, shape) in enumerate(table.items())
            ]
        ]
    index = {name: i for i, name in enumerate(table)}
    split = split_sequential if pattern == SEQUENTIAL else split_strided
    spans = split([(name, numel(shape)) for name, shape in table.items()], num_fragments)
    return [
        [
            Piece(
                f"{s.name}[{s.start}:{s.stop}]", s.name, index[s.name], s.start, s.stop, (s.numel,)
            )
            for s in fragment
        ]
        for fragment in spans
    ]


def split_sequential(sizes: Sequence[tuple[str, int]], num_fragments: int) -> list[list[Span]]:
    """Cut the concatenation of all parameters (in the given order) into ``num_fragments``
    contiguous pieces of equal size (to within one element). Neighbouring layers stay together,
    which suits pipeline stages."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    total = sum(n for _, n in sizes)
    if total < num_fragments:
        raise ValueError(f"{total} elements cannot make {num_fragments} non-empty fragments")
    bounds = [total * i // num_fragments for i in range(num_fragments + 1)]
    fragments: list[list[Span]] = [[] for _ in range(num_fragments)]
    offset = 0
    f = 0
    for name, n in sizes:
        start = 0
        while start < n:
            while offset + start >= bounds[f + 1]:
                f += 1
            stop = min(n, bounds[f + 1] - offset)
            fragments[f].append(Span(name, start, stop))
            start = stop
        offset += n
    return fragments


def split_strided(sizes: Sequence[tuple[str, int]], num_fragments: int) -> list[list[Span]]:
    """Interleave: cut the concatenation into ``num_fragments * num_fragments`` equal slices and
    give slice j to fragment ``j % num_fragments``, so each fragment samples every depth of the
    network (early, middle and late layers) and all are equal in size to within a few elements."""
    fine = split_sequential(sizes, num_fragments * num_fragments)
    out: list[list[Span]] = [[] for _ in range(num_fragments)]
    for j, piece in enumerate(fine):
        out[j % num_fragments].extend(piece)
    return out


def sync_offsets(sync_every: int, num_fragments: int) -> list[int]:
    """Inner steps (1..sync_every) at which fragment 0, 1, ... syncs within each period: every
    fragment exactly once per ``sync_every`` steps, spread evenly, also when ``sync_every`` is not
    a multiple of the fragment count."""
    if num_fragments < 1 or sync_every < num_fragments:
        raise ValueError(
            f"need 1 <= num_fragments <= sync_every, got {num_fragments} and {sync_every}"
        )
    return [math.floor((f + 1) * sync_every / num_fragments) for f in range(num_fragments)]


def fragment_due(step: int, sync_every: int, num_fragments: int) -> int | None:
    """The fragment that syncs after inner step ``step`` (counted from 1), or None."""
    if step < 1:
        raise ValueError("steps are counted from 1")
    within = (step - 1) % sync_every + 1
    offsets = sync_offsets(sync_every, num_fragments)
    return offsets.index(within) if within in offsets else None


class Schedule:
    """Which fragment is due after each inner step: every fragment exactly once per period."""

    def __init__(self, sync_every: int, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self.phase = 0  # inner steps taken in the current period
        self.retime(sync_every)

    def retime(self, sync_every: int) -> None:
        """A new period length; takes effect at the start of a period (phase 0)."""
        assert self.phase == 0, "the schedule changes only between periods"
        self.sync_every = sync_every
        offsets = sync_offsets(sync_every, self.num_fragments)
        self._due = {step: f for f, step in enumerate(offsets)}

    def advance(self) -> int | None:
        """Count one inner step; the fragment due after it, or None."""
        self.phase += 1
        due = self._due.get(self.phase)
        if self.phase >= self.sync_every:
            self.phase = 0
        return due
