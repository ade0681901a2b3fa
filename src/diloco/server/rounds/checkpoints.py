"""Checkpoints: resuming from one, writing one (periodic or on request), and publishing an outer
update with the checkpoint it may owe first.

Publication lives here because durability decides how a result is published: a round that is
to be saved is written to disk before its first byte leaves, so no worker adopts parameters a
crash could take back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco.core.fragments import SEQUENTIAL
from diloco.core.outer import PieceDone
from diloco.persistence import Checkpoint, merge_states, save_checkpoint, split_states
from diloco.server.config import ServerConfig
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.records import SaveRecord
from diloco.server.params.store import ParamStore
from diloco.server.rounds.synced_model import Model
from diloco.server.rounds.units import Unit

log = logging.getLogger(__name__)


class Checkpoints:
    """Owns what was restored, the last save and its error; writes under the tensor lock."""

    def __init__(
        self, config: ServerConfig, model: Model, registry: WorkerRegistry, lock: asyncio.Lock
    ) -> None:
        self.config = config
        self.model = model
        self.registry = registry
        self.lock = lock
        self.restored: Checkpoint | None = None  # until the units are planned from it
        self.resumed_from: str | None = None
        self.last_save: SaveRecord | None = None
        self.last_save_error: str | None = None
        #: What a front adds to every checkpoint's ``state.json`` (a relay: its upstream link's
        #: state, server/relay/), read as the checkpoint is written.
        self.extra_state: Callable[[], dict[str, Any]] | None = None

    # --- resuming -------------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint) -> ParamStore:
        """Check a checkpoint against this server and return its parameters as a store; each
        unit's round and outer optimizer state, counters and receipts follow when the units are
        planned (``unit_rounds``, ``load``). A checkpoint of another mode or fragmenting is
        refused: its optimizer state would not fit."""
        order = ckpt.extra.get("param_order") or list(ckpt.params)
        if sorted(order) != sorted(ckpt.params):
            raise ValueError(f"{ckpt.path}: param_order does not match the saved parameters")
        mode = ckpt.extra.get("mode", "sync")
        if mode != self.config.mode:
            raise ValueError(
                f"{ckpt.path} was saved in {mode} mode; start the server in {mode} mode, "
                "or without this save dir"
            )
        num, pattern = ckpt.extra.get("fragments", [1, SEQUENTIAL])
        saved = (int(num), str(pattern))
        fragmenting = self.model.fragmenting
        if fragmenting is not None and fragmenting[0] != saved[0]:
            raise ValueError(
                f"{ckpt.path} holds {saved[0]} fragment(s), the server was asked for "
                f"{fragmenting[0]}"
            )
        if saved[0] > 1 and self.config.lossy_download:
            raise ValueError(
                f"{ckpt.path} holds {saved[0]} fragments; --download-codec "
                f"{self.config.download_codec} publishes updates of the whole model only"
            )
        self.model.fragmenting = saved
        self.restored = ckpt
        self.registry.deaths = int(ckpt.extra.get("worker_deaths", 0))
        self.resumed_from = str(ckpt.path)
        log.info("resumed from %s at round %d", ckpt.path, ckpt.round)
        return ParamStore.from_tensors({n: ckpt.params[n] for n in order}, round=ckpt.round)

    def unit_rounds(self) -> list[int] | None:
        """Each unit's round in the restored checkpoint (None: nothing restored)."""
        ckpt = self.restored
        if ckpt is None:
            return None
        assert self.model.fragmenting is not None
        num = self.model.fragmenting[0]
        rounds = [int(r) for r in ckpt.extra.get("unit_rounds", [ckpt.round])]
        if len(rounds) != num:
            raise ValueError(f"{ckpt.path}: unit_rounds has {len(rounds)} entries, not {num}")
        return rounds

    def load(self, units: list[Unit]) -> None:
        """Give freshly planned units their outer optimizer state and receipts, if restored."""
        ckpt, self.restored = self.restored, None
        if ckpt is None:
            return
        saved_class = ckpt.extra.get("outer_optimizer")
        ours = type(units[0].optimizer).__name__
        if saved_class is not None and saved_class != ours:
            raise ValueError(
                f"{ckpt.path} holds {saved_class} state; this server's outer optimizer is {ours}"
            )
        states = split_states(ckpt.optimizer_state, ckpt.extra.get("optimizer_units"))
        if len(states) != len(units):
            raise ValueError(
                f"{ckpt.path}: optimizer state for {len(states)} units, not {len(units)}"
            )
        for unit, state in zip(units, states, strict=True):
            unit.optimizer.load_state_dict(state)
        for entry in ckpt.extra.get("receipts", []):
            sid, counted_in = entry[0], int(entry[1])
            index = int(entry[2]) if len(entry) > 2 else 0
            units[index].aggregator.restore_receipt(str(sid), counted_in)

    # --- writing --------------------------------------------------------------------------------

    def write(self, store_round: int, unit_rounds: list[int]) -> Path:
        """Blocking: write the parameters and every unit's state as of ``unit_rounds``. The
        caller holds the tensor lock (nothing changes them mid-write) and runs this off the
        event loop."""
        store, units = self.model.store, self.model.units
        assert self.config.save_dir is not None and store is not None and units
        assert self.model.fragmenting is not None
        receipts = [
            [sid, r, unit.index]
            for unit, upto in zip(units, unit_rounds, strict=True)
            # Receipts of rounds (versions) whose result is inside these parameters.
            for sid, r in list(unit.aggregator.history.items())
            if r < upto
        ]
        merged, shape = merge_states([u.optimizer for u in units])
        extra = {
            "param_order": [s.name for s in store.specs],
            "mode": self.config.mode,
            "fragments": list(self.model.fragmenting),
            "unit_rounds": unit_rounds,
            "optimizer_units": shape,
            "outer_optimizer": type(units[0].optimizer).__name__,
            "receipts": receipts,
            "worker_deaths": self.registry.deaths,
            "instance": store.instance,
        }
        if self.extra_state is not None:
            extra.update(self.extra_state())
        # What the workers hold is the checkpoint's parameters; with a lossy downlink the
        # outer step's true copy goes beside them, so a restart goes on bit for bit.
        extra["download_codec"] = self.config.download_codec
        path = save_checkpoint(
            self.config.save_dir,
            store_round,
            store.published(),
            merged,
            extra,
            self.config.keep_checkpoints,
            true=store.named() if store.has_true else None,
        )
        self.last_save = SaveRecord(store_round, str(path))
        log.info("saved round %d to %s", store_round, path)
        return path

    async def save(self) -> Path | None:
        """Write a checkpoint now (off the event loop). None when saving is not configured or
        there is nothing to save yet.

        The tensor lock keeps outer steps from changing parameters or momentum mid-write;
        uploads being received and downloads go on meanwhile."""
        if self.config.save_dir is None or self.model.store is None or not self.model.units:
            return None
        async with self.lock:
            store = self.model.require_store()
            rounds = [u.published_round for u in self.model.units]
            return await asyncio.to_thread(self.write, store.round, rounds)

    def _durable(self, store_round: int) -> bool:
        every = self.config.save_every
        return self.config.save_dir is not None and every > 0 and store_round % every == 0

    def _write_quietly(self, store_round: int, unit_rounds: list[int]) -> None:
        """Written before the result is published: no worker ever adopts parameters a crash
        could take back, so no accepted contribution is lost with them. A full disk must not
        stop training."""
        try:
            self.write(store_round, unit_rounds)
        except OSError as exc:
            self.last_save_error = f"round {store_round}: {exc}"
            log.error("checkpoint of round %d failed: %s", store_round, exc)

    # --- publishing -----------------------------------------------------------------------------

    async def publish(
        self,
        unit: Unit,
        unit_round: int,
        outer_step: Callable[[PieceDone | None], None],
        before: Callable[[], None] | None = None,
    ) -> None:
        """Run ``outer_step`` on ``unit`` off the event loop (caller holds the tensor lock),
        write a periodic checkpoint if one is due, then publish: the unit's round becomes
        ``unit_round`` and the store's update count moves by one. ``before`` runs on the loop
        just before the unit's round moves (the barrier opens its next round there, the async
        gate advances its version), and so before any download of the new round can end.

        When the unit is the whole model, downloads of the new round start as the step begins
        and stream each part as soon as it is final: ``outer_step`` gets a progress callback to
        pass to ``apply_outer_step``."""
        store = self.model.require_store()
        units = self.model.units
        downlink, sparse = self.model.downlink, self.model.sparse
        new_round = store.round + 1
        rounds = [u.published_round for u in units]
        rounds[unit.index] = unit_round
        durable = self._durable(new_round)

        def step(progress: PieceDone | None) -> None:
            outer_step(progress)
            if downlink is not None:
                downlink.encode(new_round)  # the published payload follows the true copy
            if sparse is not None:  # the positions the sum touched, with their new values
                sparse.encode(new_round, unit.names, unit.sum.sums)
            if durable:
                self._write_quietly(new_round, rounds)

        def publish() -> None:
            if before is not None:
                before()
            unit.published_round = unit_round

        # A round that is to be durable is not streamed while it is written: its first byte
        # leaves only once its checkpoint is on disk, so no worker drops progress for a result
        # a crash could take back (a worker adopts a streamed round as its bytes land). With a
        # lossy downlink the payload is written after the step (by the update), and a sparse
        # update is built from the step's result, so the round is published when done.
        await store.update(
            step,
            new_round=new_round,
            on_publish=publish,
            stream=len(units) == 1 and not durable and downlink is None and sparse is None,
        )
