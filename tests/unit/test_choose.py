"""The strategy rule (``worker/choose.py``): the server's mode picks the family, ``num_fragments``
the share of the model a round moves; a re-registration must find the same family."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.wire.messages import OuterStep, Registered, Rendezvous
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.allreduce.whole_model import WholeModel
from diloco.worker.choose import choose_strategy, same_family
from diloco.worker.server_mode.plain import PlainSync
from diloco.worker.server_mode.streaming import StreamingSync


def registered(mode: str) -> Registered:
    """A registration reply from a server in ``mode`` (all-reduce mode's fields included)."""
    allreduce = mode == "allreduce"
    return Registered(
        worker_id="w",
        round=0,
        mode=mode,
        instance="i",
        has_params=not allreduce,
        num_workers=1,
        poll_timeout=30.0,
        codecs=("fp32",),
        fragments=None,
        fragment_rounds=None,
        rendezvous=Rendezvous(path="/rendezvous") if allreduce else None,
        collective_timeout=30.0 if allreduce else None,
        weighting="equal" if allreduce else None,
        outer=OuterStep(lr=0.7, momentum=0.9, nesterov=True) if allreduce else None,
    )


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
    chosen = choose_strategy(w.settings, w._session, None, registered(mode), submit=w._submit)
    assert type(chosen) is kind
    if payload is not None:
        assert type(chosen._payload) is payload  # type: ignore[attr-defined]


def test_a_reregistration_must_find_the_family_it_joined() -> None:
    same_family(False, registered("async"))  # sync -> async is still a parameter server
    same_family(True, registered("allreduce"))
    with pytest.raises(ValueError, match="now runs in all-reduce mode"):
        same_family(False, registered("allreduce"))
    with pytest.raises(ValueError, match="now runs in parameter-server mode"):
        same_family(True, registered("sync"))
