"""The all-reduce mode's rendezvous store (server/allreduce/rendezvous.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.wire.messages import quorum_prefix


@pytest.mark.timeout(30)
def test_one_store_serves_every_quorum_under_its_own_prefix() -> None:
    with RendezvousStore("127.0.0.1", timeout=5.0) as rv:
        host, port = rv.address()
        assert (host, port) == ("127.0.0.1", rv.port) and port > 0
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        for quorum in ("r1", "r2"):
            dist.PrefixStore(quorum_prefix(quorum), client).set("0/0", quorum)
        assert client.get("quorum/r1/0/0") == b"r1"
        assert rv.forget("r1") == 1
        assert client.check(["quorum/r2/0/0"]) and not client.check(["quorum/r1/0/0"])
    with pytest.raises(RuntimeError, match="closed"):
        rv.forget("r2")


@pytest.mark.parametrize("bad", ["", "a/b", "a b", "x" * 65])
def test_quorum_ids_cannot_overlap_another_quorums_prefix(bad: str) -> None:
    with pytest.raises(ValueError, match="quorum id"):
        quorum_prefix(bad)
