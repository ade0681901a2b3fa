"""DiLoCoWorker: wraps any training loop through an optimizer post-step hook.

The worker is its lifecycle: it hooks the optimizer, registers with the server, fetches the
first global parameters, sends heartbeats (and follows DyLU's ``sync_every``), re-joins when the
server forgot it, and leaves. How it syncs is a ``SyncStrategy`` (``worker/strategy.py``), chosen
once from the settings and the first registration reply (``worker/choose.py``). The model and its
snapshot of the global parameters are a ``LocalModel``; what the lifecycle and the strategy
share is one ``Session``.

Memory: besides the model, the worker keeps one fp32 snapshot of the global parameters, laid
out exactly like the server's download body so new parameters are read straight into it.
Pseudo-gradients are computed tensor by tensor as they are sent; no second model copy exists
but a lossy codec's error-feedback residual (``worker/state/encoder.py``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from diloco.core.outer_rules import ef_decay
from diloco.wire.messages import Registered, RegisterInfo
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.allreduce.shard_exchange import HttpLink
from diloco.worker.choose import choose_strategy, same_family
from diloco.worker.groups.group import WorkerGroup, find_group
from diloco.worker.groups.group_sync import GroupSync, Lockstep
from diloco.worker.heartbeats import Heartbeats
from diloco.worker.logs import show_worker_log
from diloco.worker.server_mode.plain import PlainSync
from diloco.worker.session import Session, initial_metrics
from diloco.worker.settings import WorkerSettings, chosen_codec, off_reason, refused_codec, resolve
from diloco.worker.state.encoder import UploadEncoder, comm_dtype
from diloco.worker.state.local_model import LocalModel
from diloco.worker.state.start_state import StartState
from diloco.worker.strategy import SyncStrategy
from diloco.worker.termination import SigtermExit, Terminated
from diloco.worker.transport.client import Conflict, DiLoCoClient, ServerError, Unreachable
from diloco.worker.unwrap import real_optimizer

log = logging.getLogger(__name__)


class DiLoCoWorker:
    """Join a DiLoCo run from any training loop.

    >>> with DiLoCoWorker(model, optimizer, "10.0.0.5:8512", sync_every=500) as w:  # doctest: +SKIP
    ...     for batch in data:
    ...         loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...         w.report(loss=loss.item(), samples=len(batch))

    Arguments left as None come from ``DILOCO_*`` environment variables, then defaults (see
    ``WorkerSettings``). ``codec`` (``"int8"``, ``"int4"``, ``"lowrank:8"``) compresses uploads,
    with error feedback (``worker/state/encoder.py``; ``error_feedback=False``: without); None:
    bf16, or fp32 without ``bf16_comm``.

    Under an initialized ``torch.distributed`` (or with ``process_group``) the ranks of the group
    are one worker: rank 0 talks to the server, the others follow (``worker/groups/group.py``).
    ``partitioned`` says each rank owns different parameters (pipeline stages); None detects it.

    ``stages`` (swarm mode): the pipeline stages this worker's model may host, said in every
    registration (``RegisterInfo.stages``), so a registration again (the server restarted and
    forgot it) is given the same stage (a swarm peer's stage sync sets its own).
    ``start_state`` (all-reduce and swarm mode, the whole model, no worker group): the run's
    state to start from (a checkpoint's round, snapshot and momentum; ``StartState``) instead
    of the model's parameters at round 0.

    ``enabled=False`` (or ``DILOCO_ENABLED=0``) turns DiLoCo off: the loop trains alone, as if
    the worker were not there (``WorkerSettings.enabled``). SIGTERM, while the worker runs, ends
    the loop like Ctrl-C and the worker leaves the run (``worker/termination.py``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        server_addr: str | None = None,
        sync_every: int | None = None,
        bf16_comm: bool | None = None,
        worker_id: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        heartbeat_interval: float | None = None,
        retries: int | None = None,
        read_timeout: float | None = None,
        connect_timeout: float | None = None,
        max_barrier_wait: float | None = None,
        num_fragments: int | None = None,
        fragment_pattern: str | None = None,
        overlap_steps: int | None = None,
        merge_alpha: float | None = None,
        dylu: bool | None = None,
        enabled: bool | None = None,
        log_level: str | None = None,
        codec: str | None = None,
        error_feedback: bool | None = None,
        ef_decay: float | None = None,
        save_dir: str | None = None,
        client: DiLoCoClient | None = None,
        process_group: Any = None,
        partitioned: bool | None = None,
        stages: Sequence[int] | None = None,
        start_state: StartState | None = None,
    ) -> None:
        self.settings: WorkerSettings = resolve(
            {
                "server_addr": server_addr,
                "sync_every": sync_every,
                "bf16_comm": bf16_comm,
                "worker_id": worker_id,
                "token": token,
                "tls_ca": tls_ca,
                "heartbeat_interval": heartbeat_interval,
                "retries": retries,
                "read_timeout": read_timeout,
                "connect_timeout": connect_timeout,
                "max_barrier_wait": max_barrier_wait,
                "num_fragments": num_fragments,
                "fragment_pattern": fragment_pattern,
                "overlap_steps": overlap_steps,
                "merge_alpha": merge_alpha,
                "dylu": dylu,
                "enabled": enabled,
                "log_level": log_level,
                "codec": codec,
                "error_feedback": error_feedback,
                "ef_decay": ef_decay,
                "save_dir": save_dir,
            }
        )
        show_worker_log(self.settings.log_level)  # only where the program set up no logging
        #: False: DiLoCo is off, and the worker does nothing (``WorkerSettings.enabled``).
        self.enabled = self.settings.enabled
        if not self.enabled:
            log.info(
                "DiLoCo is off (%s): training runs alone, with no server, hook or thread",
                off_reason(enabled),
            )
        self.model = model
        self.optimizer = real_optimizer(optimizer)
        self.stages = None if stages is None else tuple(int(k) for k in stages)
        self._start_state = start_state
        self.client = client or DiLoCoClient(
            self.settings.server_addr,
            token=self.settings.token,
            tls_ca=self.settings.tls_ca,
            connect_timeout=self.settings.connect_timeout,
            read_timeout=self.settings.read_timeout,
            retries=self.settings.retries,
        )
        self.metrics = initial_metrics(self.settings.sync_every)
        #: How pseudo-gradients travel (``codec`` or ``bf16_comm``; ``worker/state/encoder.py``).
        self.codec = chosen_codec(self.settings)
        self._local = LocalModel(model, comm_dtype(self.codec), self.metrics)
        # A worker group (torch.distributed ranks, docs/design/groups.md): every rank
        # builds it here, and ranks that disagree fail here, before anything is sent.
        # An off worker builds no group: forming one is a collective.
        pg = find_group(process_group) if self.enabled else None
        if start_state is not None and (self.settings.num_fragments > 1 or pg is not None):
            raise ValueError(
                "start_state is the whole model's: not with num_fragments > 1 or a worker group"
            )
        self._group = (
            None
            if pg is None
            else WorkerGroup(pg, self._local, self.settings, partitioned, dylu=self.settings.dylu)
        )
        if self._group is not None:  # rank 0 of a sharded group syncs through its shards
            self._local = self._group.local
            if self._group.outer is not None:  # every rank may meet others shard with shard
                self._group.outer.positions.link = HttpLink(self.client)
        self._encoder = UploadEncoder(
            self.codec, self._local, self.metrics, self.settings.error_feedback
        )
        if self._group is not None and self._group.residuals is not None and self._group.leader:
            self._encoder.model_body = self._group.residuals.upload  # the residual on the shards
        self._session = Session(
            self.settings, self.client, self._local, self.metrics, self._rejoin, self._encoder
        )
        self._encoder.check_names()  # a group's rank 0 encodes the union of the ranks' names
        self._leads = self._group is None or self._group.leader  # talks to the server
        # The ranks of a group join and sync together (the join before any strategy exists).
        self._lockstep = None if self._group is None else Lockstep(self._group, self._session)
        # Chosen once the first registration reply is known (``worker/choose.py``).
        self._strategy: SyncStrategy | None = None
        self._allreduce = False  # the server the strategy was chosen for runs in all-reduce mode
        self._hook: Any = None
        self._registered = False  # this worker's own registration succeeded at least once
        self._heartbeats = Heartbeats(self._session, self.settings)
        self._started = False
        self._sigterm = SigtermExit(self._leave_at_exit)

    # --- what the lifecycle shares with the strategy ------------------------------------------

    @property
    def worker_id(self) -> str | None:
        return self._session.worker_id

    @property
    def codec_name(self) -> str:
        """The codec's name (``"int8"``); ``codec`` is the codec itself, with its options."""
        return self.codec.name

    @property
    def base_round(self) -> int:
        """The round of the global parameters in the snapshot."""
        return self._session.base_round

    @property
    def instance(self) -> str:
        return self._session.instance

    @property
    def local_step(self) -> int:
        return self._session.local_step

    @property
    def total_steps(self) -> int:
        return self._session.total_steps

    @property
    def sync_every(self) -> int:
        """Inner steps between syncs: the setting, or DyLU's recommendation."""
        return self._session.sync_every

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> DiLoCoWorker:
        """Hook the optimizer, register, and load the global parameters into the model. If any
        of it fails (Ctrl-C too), the worker leaves the run before the error is raised: a worker
        registered but never joined would hold every round until the server dropped it.
        With DiLoCo off, nothing (``enabled``)."""
        if self._started:
            raise RuntimeError("worker already started")
        if not self.enabled:
            return self
        s = self._session
        s.syncing = True  # the heartbeats start once registered: the loop is not hung
        if self._group is None:  # a group's ranks would leave through mismatched collectives
            self._sigterm.install()
        try:
            # Hooked first: an optimizer that refuses the hook fails before registering.
            self._hook = self.optimizer.register_step_post_hook(self._post_step)
            if self._lockstep is None:
                self._join(initial=True)
            else:
                self._lockstep.start(lambda: self._join(initial=True))
                if self._strategy is None:  # a rank that follows: it saw no reply
                    self._strategy = choose_strategy(
                        self.settings, s, self._lockstep, None, submit=self._submit
                    )
        except BaseException:
            self._abandon_start()
            raise
        finally:
            s.syncing = False
        self._started = True
        s.last_step_at = time.monotonic()
        return self

    def _unhook(self) -> None:
        """Stop seeing the optimizer's steps, stop the heartbeats, give SIGTERM back."""
        self._sigterm.restore()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._heartbeats.stop()

    def _abandon_start(self) -> None:
        """Undo a failed start: unhook, stop the heartbeats, leave the run (best effort, within
        the client's timeouts), close the client."""
        self._unhook()
        try:
            if self._registered:
                self._leave_quietly()
        finally:
            self.client.close()

    def stop(self, *, submit: bool = True, leave: bool = True) -> None:
        """Send the remaining local steps (when ``submit``), then leave the run (``leave``
        False: keep the registration, for a swarm peer that registers again under the same id
        for another stage; a deregistration would make its new stage empty again)."""
        if not self._started:
            return
        self._started = False
        self._unhook()
        assert self.worker_id is not None and self._strategy is not None
        try:
            self._strategy.finish(submit=submit)
            if self._leads and leave:
                self.client.deregister(self.worker_id)
        except (Unreachable, ServerError) as exc:
            log.warning("worker %s: could not leave cleanly: %s", self.worker_id, exc)
        finally:
            self.client.close()

    def __enter__(self) -> DiLoCoWorker:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # After a crash in the training loop the local state may be garbage: do not send it.
        # A SIGTERM outside a sync left the model holding parameters: those steps may go.
        self.stop(submit=exc_type is None or (isinstance(exc, Terminated) and exc.clean))

    def _leave_at_exit(self, submit: bool) -> None:
        """After a SIGTERM whose exception escaped the loop without stopping the worker."""
        if self._started:
            self.stop(submit=submit)

    # --- what the training loop calls -----------------------------------------------------------

    def report(
        self,
        *,
        loss: float | None = None,
        samples: float | None = None,
        tokens: float | None = None,
    ) -> None:
        """Tell the worker the latest loss (shown by the server), and the samples and the tokens
        just trained on: the weight of the next submission when the server weights by samples
        (``--weighting samples``) or by tokens (``--weighting tokens``; then every sync needs
        some reported)."""
        if loss is not None:
            self._session.loss = float(loss)
        if samples is not None:
            if samples < 0:
                raise ValueError("samples must be >= 0")
            self._session.samples += samples
            self._session.reports_samples = True
        if tokens is not None:
            if not (math.isfinite(tokens) and tokens >= 0):
                raise ValueError(f"tokens must be a finite number >= 0, got {tokens}")
            self._session.tokens += tokens
            self._session.reports_tokens = True

    @property
    def last_sync_outcome(self) -> str | None:
        """In a worker group: how the last join or sync ended, as every rank saw it
        ("joined", "adopted", "rebased", "kept_local"); None outside a group."""
        return self._lockstep.last_outcome if self._lockstep is not None else None

    def force_sync(self) -> None:
        """Sync now, whatever the step count (for example before an evaluation or a checkpoint).
        Streaming: every fragment in turn, each merged before the next is sent. In a worker
        group every rank calls it (it is a collective), as every rank calls ``stop``."""
        if not self.enabled:
            return
        if self._strategy is None:
            raise RuntimeError("the worker has not joined a run yet: call start() first")
        with self._sigterm.syncing():
            self._strategy.sync_now()

    def held_state(self) -> tuple[int, str] | None:
        """All-reduce and swarm mode: the (round, hash) of the run's state this worker holds,
        as its ``POST /quorum`` presents it (``QuorumSync.held``); None when it holds none it
        can vouch for, or syncs another way (the server holds the state)."""
        strategy = self._strategy
        return strategy.held() if isinstance(strategy, QuorumSync) else None

    @property
    def sync_metrics(self) -> dict[str, float]:
        out = dict(self.metrics)
        out["retries"] = self.client.retry_count
        out["bytes_up"] = self.client.bytes_up
        out["bytes_down"] = self.client.bytes_down
        out["local_step"] = self.local_step
        out["total_steps"] = self.total_steps
        out["round"] = self._strategy.round if self._strategy is not None else self.base_round
        return out

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        s = self._session
        s.local_step += 1
        s.total_steps += 1
        s.last_step_at = time.monotonic()
        assert self._strategy is not None  # hooked inside start(), which chose it
        with self._sigterm.syncing():
            self._strategy.after_step()

    def _submit(self, submission_id: str) -> dict[str, Any]:
        """Plain DiLoCo's upload of the whole model under ``submission_id``; the server's reply.
        Every plain upload (a sync's, the final one) goes through here, so a subclass may wrap
        it (the crash tests kill the server around it)."""
        plain = self._strategy.inner if isinstance(self._strategy, GroupSync) else self._strategy
        assert isinstance(plain, PlainSync)
        return plain.upload(submission_id)

    # --- joining --------------------------------------------------------------------------------

    def _rejoin(self) -> None:
        self._join(initial=False)

    def _join(self, *, initial: bool) -> None:
        """Register (again), choose the strategy at the first reply, and let it bring the model
        to the run's state (``SyncStrategy.join``) or reconcile it after a re-registration,
        keeping the local progress the run does not hold (``SyncStrategy.rejoin``)."""
        s = self._session
        try:
            reply = self._register(initial)
        except Conflict as exc:
            if exc.code == "fragments_mismatch":
                raise ValueError(
                    f"the server fragments the model differently: {exc.detail} "
                    "(set num_fragments and fragment_pattern as the server has them)"
                ) from exc
            # Refused before the server counted this worker. Only at the first join: a re-join
            # runs inside optimizer.step(), whose failures are counted, never raised.
            if exc.code == "params_mismatch" and initial:
                raise ValueError(
                    f"the model does not match the server's parameters: {exc.detail}"
                ) from exc
            raise
        except ServerError as exc:  # at the first join, a codec the server refuses is fatal
            refused = refused_codec(exc.reply, self.codec) if initial else None
            if refused is None:
                raise
            raise refused from exc
        s.worker_id = reply.worker_id
        self._registered = True
        if initial:
            # From here the server counts on this worker: heartbeats say it is alive however
            # long the first download of a big model takes.
            self._heartbeats.start()
            read_timeout = self.settings.read_timeout
            if reply.poll_timeout is not None and reply.poll_timeout >= read_timeout:
                log.warning(
                    "worker %s: read_timeout %g s does not outlast the server's long polls "
                    "(poll_timeout %g s): a wait for a slow round times out and is retried",
                    s.worker_id,
                    read_timeout,
                    reply.poll_timeout,
                )
        self._heartbeats.adopt_recommendation(reply)
        if self._strategy is None:
            self._strategy = choose_strategy(
                self.settings, s, self._lockstep, reply, submit=self._submit
            )
            self._allreduce = reply.quorum_sync
        else:
            same_family(self._allreduce, reply)
        if initial:
            if self._start_state is not None:
                if not isinstance(self._strategy, QuorumSync):
                    raise ValueError("start_state needs a server in all-reduce or swarm mode")
                self._strategy.start_from(self._start_state)
            self._strategy.join(reply)
            log.info("worker %s joined at round %d", s.worker_id, s.base_round)
            return
        settled = self._strategy.rejoin(reply)
        self.metrics["reconnections"] += 1
        log.info(
            "worker %s re-joined at round %d (last upload %s)", s.worker_id, s.base_round, settled
        )

    def _leave_quietly(self) -> None:
        """Deregister after a failed start, so the server does not wait for this worker.
        Best effort: the error that made it leave is the one to raise."""
        assert self.worker_id is not None
        try:
            self.client.deregister(self.worker_id)
        except (Unreachable, ServerError) as exc:
            log.warning("worker %s: could not deregister: %s", self.worker_id, exc)

    def _register(self, initial: bool) -> Registered:
        info = RegisterInfo(
            pid=os.getpid(),
            device=str(self._local.device),
            sync_every=self.settings.sync_every,
            # All-reduce mode leaves a member of a failed quorum that stops heartbeating out of
            # the next quorum after two intervals, before its eviction.
            heartbeat_interval=self.settings.heartbeat_interval,
            num_fragments=self.settings.num_fragments,
            fragment_pattern=self.settings.fragment_pattern,
            codec=dict(self._encoder.metadata),
            # All-reduce mode compares tables at registration: a worker whose model differs is
            # refused there, never inside a collective.
            params=tuple(self._local.table().items()),
            stages=self.stages,
        )
        try:
            reply = self.client.register(
                self.worker_id,
                hostname=socket.gethostname(),
                info=info,
                last_submission_id=(
                    None if initial or self._strategy is None else self._strategy.last_submission
                ),
            )
        except Unreachable as exc:
            if not initial:
                raise
            # The first day's most common error: say what to do, without the transport's
            # chained tracebacks (the last error is in the message).
            raise Unreachable(
                f"{exc}. Is a diloco server running at {self.client.base_url}? Start one with "
                "`diloco server` (README, Quick start), point this worker at yours "
                "(`server_addr`, `--server` or DILOCO_SERVER), or train without DiLoCo "
                "(DILOCO_ENABLED=0)"
            ) from None
        registered = Registered.from_json(reply)
        # Every (re-)registration: a server restarted under another rule changes the decay.
        self._encoder.set_decay(ef_decay(registered.outer_rule, self.settings.ef_decay))
        return registered
