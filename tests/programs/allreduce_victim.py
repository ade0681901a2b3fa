"""A worker of an all-reduce run that stops inside its first averaging collective, as a real
process for tests/integration/test_allreduce_faults.py to kill there.

Run as ``python -m tests.programs.allreduce_victim ADDRESS WORKER_ID [JSON]`` (JSON: more DiLoCoWorker
arguments, e.g. streaming fragments). It joins the run, trains, and at
the first all-reduce of a weighted sync prints ``{"inside": true}`` and blocks without issuing
it: the other members are then inside that all-reduce, waiting for this worker's bytes, which is
the moment the test kills it (no sleep decides it).
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

from diloco import DiLoCoWorker
from diloco.worker.allreduce.collective import QuorumCollective
from tests.helpers.allreduce import make_model


def main() -> None:
    address, worker_id = sys.argv[1], sys.argv[2]
    extra: dict[str, Any] = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    original = QuorumCollective.collective

    def collective(self: QuorumCollective, what: str, start: Any) -> None:
        if what == "all-reduce":
            print(json.dumps({"inside": True}), flush=True)
            threading.Event().wait()  # until killed
        original(self, what, start)

    QuorumCollective.collective = collective  # type: ignore[method-assign]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(999)
    with DiLoCoWorker(
        model,
        opt,
        address,
        sync_every=extra.pop("sync_every", 3),
        heartbeat_interval=0.2,
        worker_id=worker_id,
        **extra,
    ) as w:
        print(json.dumps({"joined": True}), flush=True)
        while True:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)


if __name__ == "__main__":
    main()
