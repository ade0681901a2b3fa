"""Rank 0's side of a worker group streaming fragments in all-reduce mode (docs/design/
groups.md "Streaming fragments"): ``FragmentRounds`` driven by the group's schedule
(``worker/groups/group_streaming.py``) instead of its own.

The quorum loop, the round's thread and its merge are ``FragmentRounds``'s, unchanged; this
only says, at a due step, which parameters the round's fragment touches (the run's round picks
the fragment, ``base_round mod P``), and at the merge step whether parameters outside it moved
too (a state received or taken, a rebase, a round that averaged another fragment than the one
announced), so that the group shares the whole model then. A partitioned group (pipeline
stages, ``overlap_steps`` 0 only) names every parameter at each due step: rank 0's copies of the
other ranks' parameters are then those of now whatever the round moves, and the merge sends
every rank its own back. A re-join is the quorum loop's own (``Standing``), never a due step's.
"""

from __future__ import annotations

from diloco.wire.messages import Registered
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.session import Session


class GroupedFragmentRounds:
    """A ``FragmentLeader`` (``worker/groups/group_streaming.py``) over ``QuorumSync`` with a
    ``FragmentRounds`` payload."""

    def __init__(
        self,
        session: Session,
        quorum: QuorumSync,
        payload: FragmentRounds,
        *,
        every_param: bool = False,
    ) -> None:
        self._s = session
        #: A partitioned group (``overlap_steps`` 0): every parameter is gathered to rank 0 at
        #: a due step and shared back at its merge, as a round may move any of them.
        self._every_param = every_param
        self._quorum = quorum
        self._payload = payload
        self._announced = -1  # the fragment whose parameters the group moves for this round
        self._inline_done = False  # tau 0: the round ran inside ``send_fragment`` and completed

    @property
    def last_submission(self) -> str | None:
        return self._quorum.last_submission

    @property
    def round(self) -> int:
        return self._quorum.round

    def join(self, reply: Registered) -> None:
        self._quorum.join(reply)

    def rejoin(self, reply: Registered) -> str:
        return self._quorum.rejoin(reply)

    def finish(self, *, submit: bool) -> None:
        self._quorum.finish(submit=submit)

    def wants_rejoin(self) -> bool:
        return False  # the quorum loop registers again itself when the server forgot it

    def rejoin_now(self) -> None:
        raise AssertionError("all-reduce mode never re-joins at a due step")

    def abandon(self) -> None:
        """Nothing to cut short: the round in flight ends within its quorum's timeout."""

    def due_params(self, k: int) -> list[str]:
        self._announced = self._s.base_round % self._payload.num_fragments
        if self._every_param:
            return list(self._s.local.params)
        return self._payload.fragment_params(self._announced)

    def send_fragment(self, k: int) -> None:
        before = self._s.metrics["rounds"]
        self._payload.start(self._quorum)
        self._inline_done = self._payload.inflight is None and self._s.metrics["rounds"] > before

    def merge_inflight(self) -> tuple[str, bool]:
        job = self._payload.inflight
        if job is not None:
            self._payload.finish_round(job)
            done = job.completed
        else:
            done = self._inline_done
        moved_all = self._payload.moved_all or self._payload.filled != self._announced
        self._payload.moved_all = False
        return ("merge" if done else "failed"), moved_all
