"""Which sync strategy a worker runs: chosen once, here, when the server's first registration
reply is known (``DiLoCoWorker._join``), and kept for the worker's life.

The rule:

- the server's ``mode`` decides the family: ``"allreduce"`` is ``QuorumSync`` (``allreduce/``),
  and so is ``"swarm"`` (a stage's replicas sync with their stage's quorums, the same protocol),
  anything else a parameter server's strategy (``server_mode/``);
- ``num_fragments`` decides the share of the model a sync moves: 1, the whole model
  (``PlainSync``, or ``QuorumSync`` over ``WholeModel``); more, one fragment at a time
  (``StreamingSync``, or ``QuorumSync`` over ``FragmentRounds``);
- a worker group wraps whichever rank 0 runs in ``GroupSync`` (``GroupStreaming`` for
  ``StreamingSync``); the other ranks never see a reply and follow rank 0 (the same wrapper
  with no strategy inside), whatever the mode.

A re-registration must find the server in the family chosen (``same_family``): a worker does
not change strategy in the middle of a run.
"""

from __future__ import annotations

from diloco.wire.messages import Registered
from diloco.worker.allreduce.fragment_rounds import FragmentRounds
from diloco.worker.allreduce.group_rounds import GroupedFragmentRounds
from diloco.worker.allreduce.quantized import QUANTIZED
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.allreduce.sharded_fragments import SHARDED_OVERLAP, ShardedFragmentRounds
from diloco.worker.allreduce.sharded_whole import ShardedWhole, StreamedState
from diloco.worker.allreduce.shared_state import RunRules, SharedState
from diloco.worker.allreduce.whole_model import WholeModel
from diloco.worker.groups.group_streaming import GroupStreaming
from diloco.worker.groups.group_sync import GroupSync, Lockstep
from diloco.worker.groups.sharded_model import ShardedModel
from diloco.worker.groups.sharded_outer import OuterShards
from diloco.worker.server_mode.plain import PlainSync, Submit
from diloco.worker.server_mode.streaming import StreamingSync
from diloco.worker.session import Session
from diloco.worker.settings import WorkerSettings, chosen_codec
from diloco.worker.strategy import SyncStrategy


def choose_strategy(
    settings: WorkerSettings,
    session: Session,
    lockstep: Lockstep | None,
    reply: Registered | None,
    *,
    submit: Submit | None = None,
) -> SyncStrategy:
    """The strategy of a worker whose first registration got ``reply`` (None: a rank of a
    worker group other than rank 0, which registers for all). ``lockstep``: the worker group's,
    or None for a single process. ``submit``: how ``PlainSync`` uploads (the worker's
    ``_submit``). Raises ValueError for a combination not supported, before anything is
    built."""
    if lockstep is not None and not lockstep.group.leader:
        if settings.num_fragments > 1:  # rank 0 refuses all-reduce mode for it at the join
            return GroupStreaming(lockstep, session, None)
        return GroupSync(lockstep, session, None)
    assert reply is not None, "a worker that talks to the server chooses from its reply"
    if reply.quorum_sync:
        local = lockstep.group.local if lockstep is not None else None
        parts = local.outer if isinstance(local, ShardedModel) else None
        inner: SyncStrategy = _quorum_sync(settings, session, reply, lockstep, parts)
        if isinstance(inner, GroupStreaming):
            return inner
    elif settings.num_fragments > 1:
        streaming = StreamingSync(session)
        if lockstep is not None:
            return GroupStreaming(lockstep, session, streaming)
        inner = streaming
    else:
        inner = PlainSync(session, submit=submit)
    return inner if lockstep is None else GroupSync(lockstep, session, inner)


def same_family(joined_allreduce: bool, reply: Registered) -> None:
    """Raise ValueError unless a re-registration's ``reply`` comes from a server of the family
    the strategy was chosen for (``joined_allreduce``: the first reply's ``quorum_sync``)."""
    if reply.quorum_sync != joined_allreduce:
        mode = {True: "all-reduce", False: "parameter-server"}
        raise ValueError(
            f"the server now runs in {mode[not joined_allreduce]} mode; this worker joined it "
            f"in {mode[joined_allreduce]} mode (restart the worker to follow it)"
        )


SHARDED_QUANTIZED = (
    "a sharded worker group averages its whole model shard by shard, in fp32 or bf16: the "
    "int8/int4/topk collectives of the all-reduce mode average a plain member's buffers (use "
    "codec='bf16', or streaming fragments, num_fragments > 1)"
)


def _quorum_sync(
    settings: WorkerSettings,
    session: Session,
    reply: Registered,
    lockstep: Lockstep | None,
    parts: OuterShards | None,
) -> QuorumSync | GroupStreaming:
    """``QuorumSync`` over its payload; a worker group's streaming wraps it for the group, and a
    sharded group's state stays on its shards (``parts``: its per-shard outer state)."""
    partitioned = lockstep is not None and lockstep.group.partitioned
    if settings.num_fragments > 1 and partitioned and settings.overlap_steps > 0:
        raise ValueError(
            "streaming fragments of a partitioned worker group (pipeline stages) in all-reduce "
            "mode need overlap_steps=0: a state received while a round overlaps training would "
            "rebase rank 0's copies of the other ranks' parameters, which go on training; set "
            "overlap_steps=0 or run a parameter server"
        )
    if parts is not None and settings.num_fragments > 1 and settings.overlap_steps > 0:
        raise ValueError(SHARDED_OVERLAP)
    if (
        parts is not None
        and settings.num_fragments == 1
        and chosen_codec(settings).name in QUANTIZED
    ):
        raise ValueError(SHARDED_QUANTIZED)
    if parts is not None:  # a sharded group: the state stays on its shards
        sharded = StreamedState(session, RunRules.of(reply), parts, parts.positions)
        if settings.num_fragments == 1:
            return QuorumSync(session, sharded, ShardedWhole(session, sharded))
        assert lockstep is not None
        fragments = ShardedFragmentRounds(session, sharded, parts)
        rounds = QuorumSync(session, sharded, fragments)
        return GroupStreaming(lockstep, session, GroupedFragmentRounds(session, rounds, fragments))
    state = SharedState(session, RunRules.of(reply))
    if settings.num_fragments == 1:
        return QuorumSync(session, state, WholeModel(session, state))
    payload = FragmentRounds(session, state)
    quorum = QuorumSync(session, state, payload)
    if lockstep is None:
        return quorum
    # A partitioned group's rank 0 takes every rank's parameters at each due step: a round may
    # move them all (a state received, a rebase), and its copies must be those of now.
    grouped = GroupedFragmentRounds(session, quorum, payload, every_param=partitioned)
    return GroupStreaming(lockstep, session, grouped)
