"""All-reduce mode: a streaming worker left out until it registers again (issue 26: the checks
excluded it ``EXCLUSIONS_LEFT_OUT`` rounds in a row) rejoins with the run's state, and its
per-fragment counters start again with it (worker/allreduce/fragment_rounds.py ``take_state``).

Three workers in threads with real gloo groups, a real server on loopback, two fragments with
rounds on the training thread (a fragment due every ``PERIOD`` steps). w2's model is set to NaN
just before its 2nd, 3rd and 4th due points: each of those rounds leaves it out, and the third
leaves it out of quorums until it registers again. At its 5th due point it is refused (409
``left_out``, ``rejoin``); at its 6th it registers again and its quorum hands it the run's state.
Then every worker forces a round at once: w2 has trained nothing since it took the state.

- Before the fix ``take_state`` was the loop's own and reset only the whole model's counters:
  the forced round averaged w2's all-zero pseudo-gradient with weight 1 (its fragment's mark
  still dated from before the dropped steps), and the 6 steps dropped at the rejoin were counted
  as 0 (the schedule's phase).
- Now its weight there is 0, and its ``dropped_steps`` count every step up to the rejoin once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.allreduce import EVERY, run_faulty

FRAGMENTS = 2
PERIOD = EVERY // FRAGMENTS  # inner steps between two due points
ROUNDS = 4  # ROUNDS * EVERY steps: 8 due points


def due(n: int) -> int:
    """The step (counted from 0) after which the worker's ``n``-th due point comes."""
    return n * PERIOD - 1


POISONED = (due(2), due(3), due(4))
REJOIN = due(6)
FORCED = REJOIN + 1  # before this step every worker forces a round


@dataclass(frozen=True)
class Contribution:
    worker: str
    weight: float
    zero: bool  # the pseudo-gradient is all zeros
    forced: bool  # in the round every worker forced right after w2's rejoin


@pytest.mark.timeout(120)
def test_a_streaming_worker_rejoining_after_exclusions_starts_its_counters_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lock = threading.Lock()
    seen: list[Contribution] = []
    forcing: set[str] = set()
    registered_again = threading.Event()
    registrations: list[str] = []

    original_contribution = FragmentRounds.contribution

    def contribution(
        self: FragmentRounds, q: Assignment, weighted: bool
    ) -> tuple[list[torch.Tensor], float]:
        tensors, weight = original_contribution(self, q, weighted)
        worker = str(self._s.worker_id)
        zero = not any(bool(t.any()) for t in tensors)
        with lock:
            seen.append(Contribution(worker, weight, zero, worker in forcing))
        return tensors, weight

    original_register = DiLoCoClient.register

    def register(client: DiLoCoClient, worker_id: str | None = None, **kw: Any) -> Any:
        reply = original_register(client, worker_id, **kw)
        if worker_id == "w2":
            registrations.append(worker_id)
            if len(registrations) == 2:
                registered_again.set()
        return reply

    monkeypatch.setattr(FragmentRounds, "contribution", contribution)
    monkeypatch.setattr(DiLoCoClient, "register", register)

    def fault(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank == 2 and step in POISONED:
            with torch.no_grad():
                for p in w._local.params.values():
                    p.fill_(float("nan"))
        if rank != 2 and step == REJOIN:
            # The others' quorum at this due point waits for w2, which registers again at its
            # own (it is left out until then, so a quorum would form without it).
            assert registered_again.wait(60), "w2 never registered again"
        if step == FORCED:
            forcing.add(f"w{rank}")
            w.force_sync()
            forcing.discard(f"w{rank}")

    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results, held = run_faulty(
            srv.address, 3, ROUNDS, fault, num_fragments=FRAGMENTS, overlap_steps=0
        )
        status = srv.status()

    assert registered_again.is_set()
    assert status["excluded_rounds"] == [{"worker_id": "w2", "rounds": 3, "in_a_row": 0}]
    assert status["left_out"] == []
    forced = {c.worker: (c.weight, c.zero) for c in seen if c.forced}
    # w2 trained nothing since it took the state: it adds zeros, with weight 0; the others
    # average what they trained since their last round.
    assert forced["w2"] == (0.0, True), forced
    assert all(forced[w][0] > 0 and not forced[w][1] for w in ("w0", "w1")), forced
    assert [c for c in seen if c.weight > 0 and c.zero] == []
    m = results[2]["metrics"]
    assert m["excluded_rounds"] == 3
    # Dropped once each: steps 1-6 at the first left-out merge (fragment 1 had never been
    # contributed), 7-9 and 10-12 at the next two, 13-18 at the rejoin (its refused sync took
    # none): every step up to the rejoin, none twice.
    assert m["dropped_steps"] == REJOIN + 1
    common = set.intersection(*(set(held[r]) for r in range(3)))
    assert common and all(len({held[r][n][0] for r in range(3)}) == 1 for n in common)
    assert all(bool(torch.isfinite(t).all()) for t in results[2]["params"].values())
