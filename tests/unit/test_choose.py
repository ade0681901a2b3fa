"""The strategy rule (``worker/choose.py``): the server's mode picks the family, ``num_fragments``
the share of the model a round moves; a re-registration must find the same family."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.allreduce.whole_model import WholeModel
from diloco.worker.choose import choose_strategy, same_family
from diloco.worker.server_mode.plain import PlainSync
from diloco.worker.server_mode.streaming import StreamingSync


def unstarted(**kw: Any) -> DiLoCoWorker:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCoWorker(model, opt, "127.0.0.1:1", sync_every=4, heartbeat_interval=0, **kw)


@pytest.mark.parametrize(
    ("mode", "fragments", "kind", "payload"),
    [
        ("sync", 1, PlainSync, None),
        ("async", 1, PlainSync, None),
        ("sync", 2, StreamingSync, None),
        ("allreduce", 1, QuorumSync, WholeModel),
        ("allreduce", 2, QuorumSync, FragmentRounds),
    ],
)
def test_the_mode_picks_the_family_and_num_fragments_the_share(
    mode: str, fragments: int, kind: type, payload: type | None
) -> None:
    w = unstarted(num_fragments=fragments)
    chosen = choose_strategy(w.settings, w._session, None, {"mode": mode}, submit=w._submit)
    assert type(chosen) is kind
    if payload is not None:
        assert type(chosen._payload) is payload  # type: ignore[attr-defined]


def test_a_reregistration_must_find_the_family_it_joined() -> None:
    same_family(False, {"mode": "async"})  # sync -> async is still a parameter server
    same_family(True, {"mode": "allreduce"})
    with pytest.raises(ValueError, match="now runs in all-reduce mode"):
        same_family(False, {"mode": "allreduce"})
    with pytest.raises(ValueError, match="now runs in parameter-server mode"):
        same_family(True, {"mode": "sync"})
