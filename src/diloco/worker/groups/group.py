"""Worker groups: the ranks of a ``torch.distributed`` group are ONE DiLoCo worker
(docs/design/groups.md).

Rank 0 of the group is the only one that talks to the server: it registers, sends heartbeats,
uploads and downloads, through the strategy chosen for it (``PlainSync``, or ``QuorumSync`` in
all-reduce mode). Every rank's optimizer hook fires at the same steps; at a sync all ranks enter
the same sequence of collectives on the group:

1. the samples and tokens reported since the last sync are summed onto rank 0 (the upload's
   weight);
2. partitioned models only: every rank's parameters are gathered into rank 0's mirrors of them,
   so rank 0's ``LocalModel`` holds the union;
3. rank 0 syncs with the server. Replicated: its parameters are broadcast bucket by bucket
   (a fixed plan every rank knows) into the other ranks' receive buffers, each bucket as soon as
   the download has adopted it (overlapping the download) and the rest once rank 0's sync ends;
4. rank 0 broadcasts its report (the outcome, the round, the next ``sync_every``, its metrics, or
   the error that ended it, and whether the buckets hold its final parameters). Other ranks wait
   for the report only, never on the network: rank 0's retries and ``max_barrier_wait`` bound
   the wait;
5. the other ranks copy their receive buffers into their parameters, or, if the report says a
   bucket went out before a download broke off or was redone, rank 0's parameters are broadcast
   again (partitioned: always scattered), so all ranks end the sync bit-identical to rank 0.

Nothing here is home-made transport: broadcast, gather, scatter and all_reduce of
``torch.distributed`` (gloo on CPU, NCCL on CUDA). Small values (the agreement facts, reports)
travel as JSON bytes in those tensor collectives (``worker/groups/json_collectives.py``), never
pickled.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from diloco.core.fragments import numel
from diloco.worker.groups.agreement import Table, agree
from diloco.worker.groups.json_collectives import all_gather_json, broadcast_json
from diloco.worker.groups.shard_table import agree_on_shards, describe
from diloco.worker.groups.sharded import ShardState
from diloco.worker.groups.sharded_codec import ResidualShards
from diloco.worker.groups.sharded_model import ShardedModel
from diloco.worker.groups.sharded_outer import OuterShards
from diloco.worker.groups.sharded_pieces import PieceShards
from diloco.worker.settings import WorkerSettings, chosen_codec
from diloco.worker.state.local_model import LocalModel

log = logging.getLogger(__name__)

SHARE_BUCKET_BYTES = 32 << 20
"""Small parameters are broadcast together in flat buckets of at most this size."""

STREAM_BUCKET_BYTES = 4 << 20
"""Replicated groups: parameters smaller than this travel together in flat buckets of at most
this size, larger ones alone (no copy on rank 0), each bucket as soon as it is adopted."""



def find_group(process_group: Any) -> Any:
    """The group that forms one worker: the one given, else the default group of an initialized
    ``torch.distributed`` with more than one rank, else None (a single-process worker)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@dataclass
class LeaderReport:
    """What rank 0 tells every rank after a join or a sync."""

    ok: bool
    outcome: str = ""  # "joined", "adopted", "rebased" or "kept_local"
    error: str = ""
    worker_id: str | None = None
    base_round: int = 0
    sync_every: int = 0
    metrics: dict[str, float] | None = None
    streamed: bool = False  # the buckets broadcast before this report hold rank 0's parameters


class WorkerGroup:
    """The ranks of ``pg`` as one worker: the agreement check at construction and the
    collectives that move parameters and rank 0's reports. ``local``: the model the worker
    uses from here (rank 0 of a sharded group: its ``ShardedModel``)."""

    def __init__(
        self,
        pg: Any,
        local: LocalModel,
        settings: WorkerSettings,
        partitioned: bool | None,
        *,
        dylu: bool,
    ) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.leader = self.rank == 0
        self._local = local
        own: Table = {n: (tuple(p.shape), str(p.dtype)) for n, p in local.params.items()}
        mine = {
            "table": {n: [list(shape), dtype] for n, (shape, dtype) in own.items()},
            "sync_every": settings.sync_every,
            "num_fragments": settings.num_fragments,
            "partitioned": partitioned,
            "dylu": dylu,
            "codec": chosen_codec(settings).name,
            "shards": describe(local.params),
        }
        infos = all_gather_json(mine, pg, device=local.device)
        for info in infos:  # JSON has no tuples
            info["sharded"] = any("plain" not in d for d in info["shards"].values())
            info["table"] = {
                n: (tuple(shape), dtype) for n, (shape, dtype) in info["table"].items()
            }
        self.partitioned = agree(infos)
        self.tables: list[Table] = [info["table"] for info in infos]
        self.local = local
        #: Sharded (DTensor parameters): every rank's shards and rank 0's commands to them.
        self.shards: ShardState | None = None
        self.outer: OuterShards | None = None  # its all-reduce state, on every rank
        self.residuals: ResidualShards | None = None  # a lossy codec's residual, on the owners
        if any(info["sharded"] for info in infos):
            ranks = dist.get_process_group_ranks(pg)
            plans = agree_on_shards([i["shards"] for i in infos], self.tables, ranks)
            self.shards = ShardState(pg, self.rank, local.params, plans, local.device)
            outer = self.outer = OuterShards(self.shards)  # all-reduce mode's commands
            pieces = PieceShards(self.shards)  # streaming fragments' commands, on every rank
            self.residuals = ResidualShards(self.shards)
            if self.leader:
                self.local = ShardedModel.of(local, self.shards, outer, pieces)
        self._mirrors: dict[str, torch.Tensor] = {}
        if self.partitioned and self.leader:
            # Rank 0 syncs the union: its own parameters, then a mirror of every other rank's.
            union = dict(local.params)
            for table in self.tables[1:]:
                for name, (shape, dtype) in table.items():
                    mirror = torch.empty(shape, dtype=_dtype(dtype), device=local.device)
                    self._mirrors[name] = mirror
                    union[name] = torch.nn.Parameter(mirror, requires_grad=False)
            local.params = union
        # Replicated: the buckets of the streamed broadcast (the same plan on every rank).
        self._plan: list[list[str]] = [] if self.partitioned or self.shards else _plan(local.params)
        self._stream: _BucketStream | None = None
        self._inbox: list[torch.Tensor] = []  # the other ranks' receive buffers, one per bucket
        if self._plan and self.leader:
            self._stream = _BucketStream(self)
        log.info(
            "worker group of %d ranks (%s), rank %d%s",
            self.size,
            "sharded" if self.shards else "partitioned" if self.partitioned else "replicated",
            self.rank,
            ": talks to the server" if self.leader else "",
        )

    # --- collectives ----------------------------------------------------------------------------

    def pool_counts(self, samples: float, tokens: float) -> tuple[float, float]:
        """Sum the samples and the tokens each rank reported since its last contribution (one
        collective); rank 0 gets the sums (kept until an upload takes them), the other ranks
        start again from zero."""
        t = torch.tensor([samples, tokens], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, group=self.pg)
        if not self.leader:
            return 0.0, 0.0
        return float(t[0].item()), float(t[1].item())

    def agree_on(self, flag: bool) -> bool:
        """True only if every rank says True."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t.item())

    def send_report(self, report: LeaderReport) -> None:
        assert self.leader
        broadcast_json(asdict(report), self.pg, src=True, device=self._comm_device())

    def receive_report(self) -> LeaderReport:
        """The other ranks: rank 0's report (sharded: after serving its commands)."""
        assert not self.leader
        if self.shards is not None:
            return LeaderReport(**self.shards.serve())
        return LeaderReport(**broadcast_json(None, self.pg, src=False, device=self._comm_device()))

    def broadcast_json(self, value: Any) -> Any:
        """Rank 0's JSON ``value`` on every rank (``worker/groups/json_collectives.py``: no
        pickle)."""
        return broadcast_json(value, self.pg, src=self.leader, device=self._comm_device())

    # --- the streamed broadcast (replicated) ----------------------------------------------------

    def stream_begin(self) -> None:
        """Rank 0, before its sync: adopted parameters go out bucket by bucket from now on."""
        if self._stream is not None:
            self._stream.begin()
            self._local.listener = self._stream

    def stream_end(self, adopted: bool) -> bool:
        """Rank 0, after its sync (or its error): the buckets not yet sent go out from the
        parameters as they are, and all are waited for. True if every bucket holds rank 0's
        final parameters: none went out during a download, or the one download that sent
        some was adopted in full (``adopted``) with no retry."""
        if self._stream is None:
            return False
        self._local.listener = None
        return self._stream.end(adopted)

    def stream_receive(self) -> None:
        """The other ranks: receive every bucket of the plan into the receive buffers (the
        parameters are untouched until the report says what to do with them)."""
        if not self._plan:
            return
        if not self._inbox:
            for names in self._plan:
                numel = sum(self._local.params[n].numel() for n in names)
                dtype = self._local.params[names[0]].dtype
                self._inbox.append(torch.empty(numel, dtype=dtype, device=self._comm_device()))
        works = [
            dist.broadcast(buf, group_src=0, group=self.pg, async_op=True) for buf in self._inbox
        ]
        for work in works:
            work.wait()

    def stream_apply(self) -> None:
        """The other ranks: the received buckets become the parameters."""
        for names, buf in zip(self._plan, self._inbox, strict=True):
            self._unflat(buf, [self._local.params[n].data for n in names])

    def _send_bucket(self, names: list[str]) -> Any:
        params = [self._local.params[n].data for n in names]
        if len(params) == 1 and params[0].is_contiguous():
            flat = params[0].view(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in params])
        # The work keeps ``flat`` alive until it is sent.
        return dist.broadcast(flat, group_src=0, group=self.pg, async_op=True)

    def collect(self, only: Collection[str] | None = None) -> None:
        """Partitioned: every rank's parameters (``only``: those named) into rank 0's mirrors
        (before an upload)."""
        if not self.partitioned:
            return
        for dtype in self._dtypes():
            names = [self._names(r, dtype, only) for r in range(self.size)]
            width = max(self._numel(r, n) for r, n in enumerate(names))
            if width == 0:  # no rank has one of ``only`` in this dtype (the same on every rank)
                continue
            send = self._flat([self._local.params[n].data for n in names[self.rank]], width, dtype)
            parts = [torch.empty_like(send) for _ in range(self.size)] if self.leader else None
            dist.gather(send, parts, group_dst=0, group=self.pg)
            if parts is not None:
                for r in range(1, self.size):
                    self._unflat(parts[r], [self._mirrors[n] for n in names[r]])

    def share(self, only: Collection[str] | None = None) -> None:
        """Rank 0's parameters (``only``: those named) to every rank: broadcast (replicated) or
        each rank its own (partitioned, scattered from rank 0's mirrors)."""
        if self.shards is not None:  # the shards moved with rank 0's commands; plain ones now
            plans = self.shards.plans
            self._broadcast([p.data for n, p in self._local.params.items() if plans[n].plain])
            return
        if not self.partitioned:
            params = self._local.params
            self._broadcast([p.data for n, p in params.items() if only is None or n in only])
            return
        for dtype in self._dtypes():
            names = [self._names(r, dtype, only) for r in range(self.size)]
            width = max(self._numel(r, n) for r, n in enumerate(names))
            if width == 0:  # no rank has one of ``only`` in this dtype (the same on every rank)
                continue
            parts = None
            if self.leader:
                own = [self._local.params[n].data for n in names[0]]
                parts = [self._flat(own, width, dtype)] + [
                    self._flat([self._mirrors[n] for n in names[r]], width, dtype)
                    for r in range(1, self.size)
                ]
            got = torch.empty(width, dtype=_dtype(dtype), device=self._comm_device())
            dist.scatter(got, parts, group_src=0, group=self.pg)
            if not self.leader:
                self._unflat(got, [self._local.params[n].data for n in names[self.rank]])

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast from rank 0 in place; small tensors of one dtype travel in flat buckets."""
        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if bucket and (size + nbytes > SHARE_BUCKET_BYTES or t.dtype != bucket[0].dtype):
                self._broadcast_bucket(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            self._broadcast_bucket(bucket)

    def _broadcast_bucket(self, bucket: list[torch.Tensor]) -> None:
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.broadcast(bucket[0], group_src=0, group=self.pg)
            return
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group_src=0, group=self.pg)
        if not self.leader:
            self._unflat(flat, bucket)

    # --- flat buffers ---------------------------------------------------------------------------

    def _dtypes(self) -> list[str]:
        return sorted({dtype for table in self.tables for _, dtype in table.values()})

    def _names(self, rank: int, dtype: str, only: Collection[str] | None = None) -> list[str]:
        table = self.tables[rank]
        return [n for n, (_, d) in table.items() if d == dtype and (only is None or n in only)]

    def _numel(self, rank: int, names: list[str]) -> int:
        return sum(numel(self.tables[rank][n][0]) for n in names)

    def _flat(self, tensors: list[torch.Tensor], width: int, dtype: str) -> torch.Tensor:
        out = torch.zeros(width, dtype=_dtype(dtype), device=self._comm_device())
        at = 0
        for t in tensors:
            out[at : at + t.numel()].copy_(t.reshape(-1))
            at += t.numel()
        return out

    @staticmethod
    def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        at = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[at : at + t.numel()].view(t.shape))
                at += t.numel()

    def _comm_device(self) -> torch.device:
        return self._local.device


class _BucketStream:
    """Rank 0's side of the streamed broadcast: the ``LocalModel`` listener that sends each
    bucket of the plan, in plan order, once a download has adopted all of its parameters."""

    def __init__(self, group: WorkerGroup) -> None:
        self._g = group
        self._plan = group._plan
        self.begin()

    def begin(self) -> None:
        self._sent = 0  # buckets of the plan sent so far
        self._works: list[Any] = []
        self._adopted: set[str] = set()
        self._seen = 0  # names of the current body already in _adopted
        self._early = 0  # buckets sent during a download (before the sync ended)
        self._stale = False  # a bucket went out from a body that was then started again

    def body(self) -> None:
        if self._sent:
            self._stale = True  # a retry rewrites what went out: the report asks for it again
        self._adopted.clear()
        self._seen = 0

    def adopted(self, names: list[str]) -> None:
        if len(names) == self._seen:
            return
        self._adopted.update(names[self._seen :])
        self._seen = len(names)
        while self._sent < len(self._plan) and all(
            n in self._adopted for n in self._plan[self._sent]
        ):
            self._works.append(self._g._send_bucket(self._plan[self._sent]))
            self._sent += 1
            self._early += 1

    def end(self, adopted: bool) -> bool:
        fresh = not self._stale and (self._early == 0 or adopted)
        try:
            while self._sent < len(self._plan):
                self._works.append(self._g._send_bucket(self._plan[self._sent]))
                self._sent += 1
            for work in self._works:
                work.wait()
        finally:
            self.begin()
        return fresh


def _plan(params: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The buckets of the streamed broadcast: consecutive parameters of one dtype, together up
    to ``STREAM_BUCKET_BYTES``; a parameter of that size or more (contiguous) alone."""
    plan: list[list[str]] = []
    bucket: list[str] = []
    size = 0
    dtype = None
    for name, p in params.items():
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > STREAM_BUCKET_BYTES or p.dtype != dtype):
            plan.append(bucket)
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
        dtype = p.dtype
    if bucket:
        plan.append(bucket)
    return plan


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype
