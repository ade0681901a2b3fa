"""A worker's place in one quorum round: the server's answer to ``POST /quorum`` (docs/design.md,
"All-reduce mode"), read once here into a typed record the quorum loop and its payload share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Assignment:
    """This worker's assignment to a quorum: who the members are, which state they agree on,
    who sends it to whom, and where they meet."""

    id: str  # the quorum's id (its process group's store prefix)
    rank: int
    size: int
    round: int  # the round of the state the quorum agrees on
    hash: str  # that state's hash
    source: int  # a member holding that state
    resync: tuple[int, ...]  # the members that must receive it first
    host: str  # the rendezvous
    port: int
    timeout: float
    comm: torch.dtype  # what the quorum's all-reduce carries (bf16 when every member sends it)
    save: bool  # rank 0 writes a checkpoint after the round
    made_by: str  # the quorum whose step made the starting state ("" when unknown)

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> Assignment:
        rendezvous = reply["rendezvous"]
        return cls(
            id=str(reply["quorum_id"]),
            rank=int(reply["rank"]),
            size=int(reply["size"]),
            round=int(reply["round"]),
            hash=str(reply.get("hash") or ""),
            source=int(reply["source"]),
            resync=tuple(int(r) for r in reply.get("resync", [])),
            host=str(rendezvous["host"]),
            port=int(rendezvous["port"]),
            timeout=float(reply.get("timeout", 30.0)),
            comm=torch.bfloat16 if reply.get("comm") == "bf16" else torch.float32,
            save=bool(reply.get("save")),
            made_by=str(reply.get("made_by") or ""),
        )

    @property
    def receiving(self) -> bool:
        """This worker must receive the quorum's state before contributing."""
        return self.rank in self.resync
