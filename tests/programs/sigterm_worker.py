"""A worker that takes a few steps and then waits, between two steps, for a signal: the moment a
scheduler's SIGTERM usually lands (a sync is a small share of a step's time).

    python -m tests.programs.sigterm_worker STEPS

The server's address and the worker's settings come from the ``DILOCO_*`` variables (as under
``diloco worker``). Prints ``ready`` once the steps are taken, then waits for a signal, whose
exception ends it. Each step is ``fake_step`` by +1: after STEPS of them the model is
its initial parameters + STEPS."""

from __future__ import annotations

import signal
import sys

import torch

from diloco.worker import DiLoCoWorker
from tests.helpers.workers import fake_step, make_model


def main() -> None:
    steps = int(sys.argv[1])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with DiLoCoWorker(model, opt):
        for _ in range(steps):
            fake_step(model, opt, 1.0)
        print("ready", flush=True)
        signal.pause()  # the signal lands here, between steps
    print("left without a signal", flush=True)


if __name__ == "__main__":
    main()
