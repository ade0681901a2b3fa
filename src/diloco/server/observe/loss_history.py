"""The loss the workers report, per round: what the dashboard's loss chart is drawn from.

Each upload may carry the worker's last reported ``loss`` and its inner ``steps`` so far in its
metadata (``worker/transport/client.py``); the server keeps them by the round the upload was
computed from (sync: the round it counts in; async: the version it started from). With fragments
only fragment 0's uploads are kept: one entry per worker per sync period. The last
``HISTORY_ROUNDS`` rounds are kept, in memory only: a restarted server starts a new history (a
checkpoint does not hold it), and a page reloaded while the server runs gets the whole of it from
``/status``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from diloco.server.observe.records import RoundLoss, WorkerLoss

HISTORY_ROUNDS = 2048


class LossHistory:
    """Per round: each worker's reported loss and steps, and when the last of them came."""

    def __init__(self, clock: Callable[[], float], rounds: int = HISTORY_ROUNDS) -> None:
        self.clock = clock
        self.rounds = rounds
        # round -> (time of its latest upload, worker id -> (loss, steps)); rounds in order.
        self._by_round: OrderedDict[
            int, tuple[float, dict[str, tuple[float | None, int | None]]]
        ] = OrderedDict()

    def record(self, round_: int, worker_id: str, loss: float | None, steps: int | None) -> None:
        """A counted upload toward ``round_`` said ``loss`` and ``steps`` (either may be None)."""
        if loss is None and steps is None:
            return
        rounds = self._by_round
        late = round_ not in rounds and bool(rounds) and round_ < next(reversed(rounds))
        _, workers = rounds.get(round_, (0.0, {}))
        workers[worker_id] = (loss, steps)
        rounds[round_] = (self.clock(), workers)
        if late:  # async: an upload from an older version than the last kept (rare)
            self._by_round = OrderedDict(sorted(rounds.items()))
        while len(self._by_round) > self.rounds:
            self._by_round.popitem(last=False)

    def entries(self, since: int, started_at: float) -> tuple[RoundLoss, ...]:
        """The rounds from ``since`` on, times in seconds since ``started_at``."""
        out = []
        for round_, (t, workers) in self._by_round.items():
            if round_ < since:
                continue
            losses = [loss for loss, _ in workers.values() if loss is not None]
            out.append(
                RoundLoss(
                    round=round_,
                    t=round(t - started_at, 3),
                    mean_loss=sum(losses) / len(losses) if losses else None,
                    workers=tuple(
                        WorkerLoss(worker_id=w, loss=loss, steps=steps)
                        for w, (loss, steps) in sorted(workers.items())
                    ),
                )
            )
        return tuple(out)
