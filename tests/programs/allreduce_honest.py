"""An honest worker of an all-reduce run, as a real process for
tests/processes/test_allreduce_stranger.py: a stranger attacks it at chosen moments, and the
test checks that it survives and ends where the others end.

Run as ``python -m tests.programs.allreduce_honest ADDRESS WORKER_ID TOKEN ROUNDS OUT``. It trains
``ROUNDS`` rounds of ``EVERY`` seeded SGD steps, then writes its parameters to ``OUT``
(safetensors) and prints ``{"done": true, "metrics": ...}``. Two moments of every quorum it joins
are announced on stdout, each held until the test writes a line on stdin, so that the stranger
strikes exactly then (no sleep decides it):

- ``{"moment": "published", "pid": ...}``: its gloo address is in the rendezvous (its listener
  is up) and it is about to connect to its peers;
- ``{"moment": "joined", "pid": ...}``: its group is built, before the round's collectives.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
from safetensors.torch import save_file

from diloco import DiLoCoWorker
from diloco.worker.allreduce import collective
from diloco.worker.allreduce.http_store import HttpStore
from tests.helpers.allreduce import EVERY, make_model

_HOLD = threading.Lock()  # one announced moment at a time (stdin is one line per moment)


def _announce(moment: str) -> None:
    with _HOLD:
        print(json.dumps({"moment": moment, "pid": os.getpid()}), flush=True)
        sys.stdin.readline()


def _hook() -> None:
    set_key = HttpStore.set

    def announced_set(self: HttpStore, key: str, value: Any) -> None:
        set_key(self, key, value)
        _announce("published")

    HttpStore.set = announced_set  # type: ignore[method-assign]
    build = collective.QuorumCollective.build.__func__  # type: ignore[attr-defined]

    def announced_build(cls: Any, *args: Any, **kw: Any) -> Any:
        group = build(cls, *args, **kw)
        _announce("joined")
        return group

    collective.QuorumCollective.build = classmethod(announced_build)  # type: ignore[method-assign,assignment]


def main() -> None:
    address, worker_id, token, rounds, out = sys.argv[1:6]
    torch.set_num_threads(1)
    _hook()
    rank = int(worker_id[1:])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    with DiLoCoWorker(
        model, opt, address, sync_every=EVERY, heartbeat_interval=0.2, worker_id=worker_id,
        token=token,
    ) as w:  # fmt: skip
        for _ in range(int(rounds) * EVERY):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)
        params = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}
        metrics = dict(w.sync_metrics)
    save_file(params, out)
    print(json.dumps({"done": True, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
