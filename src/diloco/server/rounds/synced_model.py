"""What the server synchronises: the parameter store and its units, and the fragmenting that
splits one into the other.

Every other part of the server reads the store and the units from here, never from the
coordinator: that is what keeps the parts from importing each other in a circle. Units are
planned once both the parameters and the fragmenting are known; who learns the last of the two
(a checkpoint, the initial upload, the first registration) calls ``build``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from diloco.core.codecs import codec_by_name
from diloco.core.codecs.downlink import check_download_codec
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request
from diloco.server.members.fragmenting import (
    Fragmenting,
    asked_fragmenting,
    configured_fragmenting,
)
from diloco.server.params.sparse_bodies import SparseDownlink
from diloco.server.params.store import ParamStore
from diloco.server.params.update_bodies import Downlink
from diloco.server.rounds.aggregator import Aggregator
from diloco.server.rounds.units import OptimizerFactory, Unit, plan_pieces
from diloco.wire.messages import Plan, RegisterInfo

log = logging.getLogger(__name__)

#: Builds a unit's aggregator at the unit's round.
AggregatorFactory = Callable[[Unit, int], Aggregator]


class Model:
    """The store, its units and the fragmenting (owned here, read by everyone)."""

    def __init__(self, config: ServerConfig, factory: OptimizerFactory) -> None:
        self.config = config
        self.factory = factory
        self.store: ParamStore | None = None
        self.units: list[Unit] = []
        #: (number of fragments, pattern): from the config, a checkpoint, or the first worker.
        self.fragmenting = configured_fragmenting(config)
        #: Workers round 0 waits for; an operator may change it (config is frozen).
        self.num_workers = config.num_workers
        #: With a lossy download codec: the true copy's encoder (server/params/update_bodies.py).
        self.downlink: Downlink | None = None
        #: With ``download_codec="sparse"``: the sparse update's builder
        #: (server/params/sparse_bodies.py).
        self.sparse: SparseDownlink | None = None

    def adopt(self, store: ParamStore, true: dict[str, torch.Tensor] | None = None) -> None:
        """Serve ``store``; with a lossy download codec its outer step gets a true copy (equal
        to ``true``, a checkpoint's, when given; else to the published parameters)."""
        self.store = store
        store.on_new_buffer = self._repoint
        store.download_codec = self.config.download_codec
        if self.config.sparse_download:
            self.sparse = SparseDownlink(store)
        elif self.config.lossy_download:
            codec = check_download_codec(codec_by_name(self.config.download_codec))
            self.downlink = Downlink(codec, store, true)
        store.refresh_header()

    @property
    def updates(self) -> Downlink | SparseDownlink | None:
        """What serves a round as an update of the previous one, if anything does."""
        return self.downlink if self.downlink is not None else self.sparse

    def _repoint(self) -> None:
        for unit in self.units:
            unit.repoint()

    def build(self, rounds: list[int] | None, aggregate: AggregatorFactory) -> list[Unit]:
        """Split the model into units (``rounds``: each unit's round, from a checkpoint)."""
        store, fragmenting = self.store, self.fragmenting
        assert store is not None and fragmenting is not None and not self.units
        num, pattern = fragmenting
        plans = plan_pieces(store, num, pattern)
        if rounds is None:
            rounds = [store.round] if num == 1 else [0] * num
        units = [
            Unit(i, pieces, store, self.factory, round=rounds[i]) for i, pieces in enumerate(plans)
        ]
        for unit in units:
            unit.aggregator = aggregate(unit, unit.published_round)
        self.units = units
        store.header_meta = self._header_meta if num > 1 else None
        store.refresh_header()
        log.info(
            "%s mode, %d unit(s) (%s): %s elements each",
            self.config.mode,
            num,
            pattern,
            "/".join(str(u.nbytes // 4) for u in units),
        )
        return units

    def _header_meta(self) -> dict[str, str]:
        """Full downloads tell a streaming worker the round of every fragment they hold."""
        return {"fragment_rounds": ",".join(str(u.published_round) for u in self.units)}

    # --- lookups --------------------------------------------------------------------------------

    def require_store(self) -> ParamStore:
        if self.store is None:
            raise ApiError(
                503,
                "no_parameters",
                "the server has no parameters yet; a worker must upload initial parameters",
            )
        return self.store

    def require_units(self) -> list[Unit]:
        self.require_store()
        if not self.units:
            raise ApiError(
                503, "not_ready", "no worker has registered yet, so the fragments are not planned"
            )
        return self.units

    def shown_round(self) -> int:
        """The round to show: the whole model's (one unit) or the store's update count."""
        if len(self.units) == 1:
            return self.units[0].round
        return self.store.round if self.store is not None else 0

    def fragment_of(self, unit: Unit) -> int | None:
        """The ``fragment`` field of replies and errors: the unit's, when the run streams
        fragments (None: left out)."""
        return unit.index if len(self.units) > 1 else None

    def unit_of(self, fragment: int | None) -> Unit:
        """The unit an upload's metadata names (``UploadMeta.fragment``, required when
        streaming)."""
        units = self.require_units()
        if fragment is None:
            if len(units) > 1:
                raise bad_request(
                    "missing_metadata",
                    f"this run syncs in {len(units)} fragments: __metadata__ needs 'fragment'",
                )
            return units[0]
        return units[self.checked_fragment(fragment)]

    def fragment_index(self, raw: str) -> int:
        """Validate a fragment number from a query."""
        self.require_units()
        try:
            index = int(raw)
        except ValueError:
            raise bad_request("bad_fragment", f"fragment must be an integer, got {raw!r}") from None
        return self.checked_fragment(index)

    def checked_fragment(self, index: int) -> int:
        """``index`` if the run has such a fragment (400 ``bad_fragment`` otherwise)."""
        units = self.require_units()
        if not 0 <= index < len(units):
            raise bad_request(
                "bad_fragment", f"fragment must be in [0, {len(units) - 1}], got {index}"
            )
        return index

    def plan(self) -> tuple[Plan | None, tuple[int, ...] | None]:
        """The fragments a streaming worker must use: for each, ``[wire name, parameter, start,
        stop]`` per piece, and each fragment's round (None, None in plain DiLoCo)."""
        if len(self.units) <= 1:
            return None, None
        plan = tuple(
            tuple((p.wire_name, p.param, p.start, p.stop) for p in unit.pieces)
            for unit in self.units
        )
        return plan, tuple(u.published_round for u in self.units)

    # --- fragmenting ----------------------------------------------------------------------------

    def asked_fragmenting(self, info: RegisterInfo) -> Fragmenting:
        """The fragmenting a registering worker asks for (``members/fragmenting.py``); also
        refused when it cannot split the parameters already held."""
        asked = asked_fragmenting(info.fragmenting, self.config, self.fragmenting)
        if self.fragmenting is None and self.store is not None:
            try:
                plan_pieces(self.store, *asked)
            except ValueError as exc:
                raise bad_request("bad_fragments", str(exc)) from None
        return asked
