"""Inner steps that reached the global model, from the server's own accounting.

Every upload a server counts carries the worker's inner steps so far (``UploadMeta.steps``, the
worker's ``total_steps``), and ``GET /status?history_since=R`` lists, per round, each worker's
last counted upload toward it (``loss_history``: round, worker id, steps). The benchmark's
workers resume from their own checkpoints after a kill, so ``total_steps`` runs on across a
worker's lives, and an upload holds all the progress since the worker's last counted one (a
rebase keeps it): the steps of a worker that reached the model are the largest ``steps`` among
its uploads that the model kept.

Which uploads the model kept:

* sync (barrier or quorum): an upload toward round ``r`` is in the model once round ``r`` closed,
  that is once the server is at round ``r + 1`` or later;
* async: an upload is in the model when it is counted (each is applied as it arrives);
* a server killed and restarted resumes from its last checkpoint, at round (version) ``R``:
  what it counted toward ``R`` or later died with it, and those entries are forgotten
  (``server_restarted``). The workers send that progress again, under a higher ``steps``.

Not counted here, so the benchmark reports them apart: steps the same worker mixed into an
upload that turned out to have counted already (the worker's ``dropped_steps``), and an upload
the server counted toward an older base after its last checkpoint and lost in its restart, that
its worker's next upload, sent again, makes up for (the largest ``steps`` wins, so nothing is
counted twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StepLedger:
    """Reached steps per worker, read from ``/status`` documents one after another."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        # (round, worker id) -> the steps its counted upload toward that round said.
        self._entries: dict[tuple[int, str], int] = {}
        self.round = 0  # the server's round (version) at the last document read

    def observe(self, status: Mapping[str, Any]) -> None:
        """Read one ``/status`` document: its round and its ``loss_history`` entries (a later
        document's entry for the same round and worker replaces an earlier one)."""
        self.round = int(status["round"])
        for entry in status.get("loss_history", ()):
            for w in entry["workers"]:
                if w.get("steps") is not None:
                    self._entries[(int(entry["round"]), w["worker_id"])] = int(w["steps"])

    def since(self) -> int:
        """The ``history_since`` to ask for: a little before the newest round seen, so a round's
        late uploads are read again."""
        newest = max((r for r, _ in self._entries), default=0)
        return max(0, min(newest, self.round) - 4)

    def server_restarted(self, resumed_round: int) -> None:
        """The server came back at ``resumed_round``: what it counted toward that round or later
        was lost with it."""
        self._entries = {k: v for k, v in self._entries.items() if k[0] < resumed_round}
        self.round = resumed_round

    def per_worker(self) -> dict[str, int]:
        """Each worker's inner steps in the model (see the module docstring)."""
        out: dict[str, int] = {}
        for (round_, worker), steps in self._entries.items():
            if self.sync and round_ >= self.round:
                continue  # its round has not closed
            out[worker] = max(out.get(worker, 0), steps)
        return out

    def reached(self) -> int:
        """Inner steps in the model, all workers."""
        return sum(self.per_worker().values())
