"""Whether the ranks of a ``torch.distributed`` group can form one worker: every rank gathers
every rank's facts (its settings and its parameter table) and runs ``agree`` on them, so every
rank raises the same ``ValueError``, naming the rank and the difference, before anything is
sent (docs/design/groups.md, "Rules")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.worker.groups.shard_table import refuse_unsupported

Table = dict[str, tuple[tuple[int, ...], str]]
"""A rank's parameters: name -> (shape, dtype)."""


def agree(infos: list[Mapping[str, Any]]) -> bool:
    """Check that the ranks can form one worker; True if the model is partitioned. Every rank
    runs this on the same gathered facts, so every rank raises the same error."""
    first = infos[0]
    for key in ("sync_every", "num_fragments", "partitioned", "dylu"):
        for r, info in enumerate(infos[1:], start=1):
            if info[key] != first[key]:
                raise ValueError(
                    f"worker group: rank {r} has {key}={info[key]!r}, rank 0 has {first[key]!r}"
                )
    if any(info["sharded"] for info in infos):
        refuse_unsupported(first)
    tables: list[Table] = [info["table"] for info in infos]
    partitioned = first["partitioned"]
    if partitioned is None:
        partitioned = any(tables[r] != tables[0] for r in range(1, len(tables))) and all(
            not (set(a) & set(b)) for i, a in enumerate(tables) for b in tables[i + 1 :]
        )
    if partitioned:
        seen: dict[str, int] = {}
        for r, table in enumerate(tables):
            for name in table:
                if name in seen:
                    raise ValueError(
                        f"worker group (partitioned): rank {r} and rank {seen[name]} both own "
                        f"parameter {name!r}"
                    )
                seen[name] = r
        return True
    for r, table in enumerate(tables[1:], start=1):
        if table != tables[0]:
            raise ValueError(f"worker group (replicated): {difference(r, table, tables[0])}")
    return False


def difference(r: int, table: Table, ref: Table) -> str:
    missing = sorted(set(ref) - set(table))[:3]
    extra = sorted(set(table) - set(ref))[:3]
    parts = []
    if missing:
        parts.append(f"lacks {missing}")
    if extra:
        parts.append(f"has {extra} that rank 0 has not")
    for name in ref:
        if name in table and table[name] != ref[name]:
            parts.append(f"has {name!r} as {table[name]}, rank 0 as {ref[name]}")
            break
    return f"rank {r} " + "; ".join(parts) + " (pass partitioned=True if each rank owns its own)"
