"""Which elements a streaming worker sends together.

The server plans the fragments (``core.fragments.plan``) and sends its plan; the worker checks it
against its own model here. When each fragment is due is ``core.fragments.Schedule``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diloco.core.fragments import Piece, numel


def plan_from_server(
    entries: Sequence[Any], table: Mapping[str, tuple[int, ...]]
) -> list[list[Piece]]:
    """Check the server's plan (``[[wire_name, param, start, stop], ...]`` per fragment) against
    the model: every element of every parameter in exactly one piece."""
    if not isinstance(entries, list | tuple) or len(entries) < 2:
        raise ValueError(f"the server's fragment plan is not a list of 2 or more: {entries!r:.200}")
    sizes = {name: numel(shape) for name, shape in table.items()}
    index = {name: i for i, name in enumerate(table)}
    plan: list[list[Piece]] = []
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in table}
    for fragment in entries:
        if not isinstance(fragment, list | tuple) or not fragment:
            raise ValueError(
                f"a fragment of the server's plan is empty or not a list: {fragment!r:.200}"
            )
        pieces = []
        for entry in fragment:
            if not (isinstance(entry, list | tuple) and len(entry) == 4):
                raise ValueError(f"bad piece in the server's fragment plan: {entry!r:.200}")
            wire_name, param, start, stop = (
                str(entry[0]),
                str(entry[1]),
                int(entry[2]),
                int(entry[3]),
            )
            if param not in sizes or not 0 <= start < stop <= sizes[param]:
                raise ValueError(f"the server's fragment piece {entry!r} does not fit the model")
            pieces.append(Piece(wire_name, param, index[param], start, stop, (stop - start,)))
            covered[param].append((start, stop))
        plan.append(pieces)
    for name, spans in covered.items():
        spans.sort()
        pos = 0
        for start, stop in spans:
            if start != pos:
                raise ValueError(f"the server's fragments cover {name!r} with a gap or an overlap")
            pos = stop
        if pos != sizes[name]:
            raise ValueError(f"the server's fragments do not cover all of {name!r}")
    return plan
