"""A relay's link to its upstream server. The relay is one worker there: it registers under an
id it keeps across restarts, heartbeats, seeds the upstream or takes its parameters, and once
per round uploads its region's mean pseudo-gradient and waits for the upstream's next
parameters. It speaks through the worker's client (``worker/transport``), so every call has the
worker's timeouts and retries.

Everything here blocks; the relay's front runs it off its event loop (``relay/front.py``). An
unreachable upstream is tried again until it answers or the relay stops: the region's workers
wait for the round meanwhile (and train on locally past their ``max_barrier_wait``).

Exactly once upstream: an upload's submission id is ``<relay id>:<relay round>:<upstream
base>``, a function of the relay's durable state (the relay id and upstream round go into each
checkpoint, the closed round into ``relay/pending.py`` before its upload). A relay killed after
its upload counted and before it published the result sends the same id again when it comes
back: the upstream answers ``duplicate`` and the relay adopts the round that holds it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from diloco.server.config import ServerConfig
from diloco.server.observe.records import UpstreamStatus
from diloco.wire import TensorSpec
from diloco.wire.messages import ParamsSeeded, Registered, RegisterInfo, Table, UploadReceipt
from diloco.worker.transport.client import (
    Conflict,
    DiLoCoClient,
    ServerError,
    UnknownWorker,
    Unreachable,
)

log = logging.getLogger(__name__)

#: Seconds between heartbeats to the upstream: well inside its ``heartbeat_timeout`` (120 s by
#: default), as a worker's 30 s are.
HEARTBEAT_S = 10.0
#: Seconds before calling an unreachable upstream again (the client already backed off within
#: each call's retries).
RETRY_S = 1.0
_DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}

Params = dict[str, torch.Tensor]


class RelayStopped(Exception):
    """The relay is shutting down: the upstream call was abandoned."""


class RelayRefused(Exception):
    """The upstream refused the relay for good (another mode, a codec it does not take, another
    model): no retry would help."""


class Upstream:
    """The upstream link's state and calls (blocking)."""

    def __init__(self, config: ServerConfig, client: DiLoCoClient | None = None) -> None:
        assert config.upstream is not None
        self.url = config.upstream
        self.codec = config.upstream_codec
        self.client = client or DiLoCoClient(
            config.upstream, token=config.upstream_token, tls_ca=config.upstream_tls_ca
        )
        #: The relay's worker id upstream; a resumed relay takes its checkpoint's.
        self.relay_id = f"relay-{uuid.uuid4().hex[:10]}"
        #: The upstream round whose parameters the relay publishes (None: none yet).
        self.round: int | None = None
        self.uploads = 0
        self.last_upload_bytes: int | None = None
        self.last_download_bytes: int | None = None
        self.last_error: str | None = None
        #: The relay's live workers now (told upstream at registration).
        self.region = 0
        #: The relay's parameter table once it holds parameters (checked by the upstream).
        self.table: Table | None = None
        self.stopping = threading.Event()
        #: Tests: called with ``("upload", id)`` just before each upload is sent and with
        #: ``("counted", id)`` once the upstream has counted it (before its result arrives).
        self.at: Callable[[str, str], None] | None = None
        self._told_region: int | None = None

    # --- durable state --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the link (``Checkpoints.extra_state``)."""
        return {"relay": {"relay_id": self.relay_id, "upstream_round": self.round}}

    def restore(self, extra: Mapping[str, Any]) -> None:
        saved = extra.get("relay")
        if not isinstance(saved, dict):
            raise ValueError(
                "the checkpoint holds no relay state (a plain server's save dir?): give the "
                "relay a save dir of its own"
            )
        self.relay_id = str(saved["relay_id"])
        up = saved.get("upstream_round")
        self.round = None if up is None else int(up)

    def public(self, region: int) -> UpstreamStatus:
        return UpstreamStatus(
            url=self.client.base_url,
            relay_id=self.relay_id,
            round=self.round,
            uploads=self.uploads,
            last_upload_bytes=self.last_upload_bytes,
            last_download_bytes=self.last_download_bytes,
            region=region,
            last_error=self.last_error,
        )

    # --- calls ----------------------------------------------------------------------------------

    def retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` until the upstream answers it; ``RelayStopped`` once the relay stops."""
        while not self.stopping.is_set():
            try:
                out = call()
            except Unreachable as exc:
                self.last_error = f"{what}: {exc}"
                log.warning("relay: upstream %s unreachable (%s); trying again", self.url, exc)
                self.stopping.wait(RETRY_S)
                continue
            self.last_error = None
            return out
        raise RelayStopped(what)

    def register(self, last_submission: str | None = None) -> Registered:
        try:
            raw = self.client.register(
                self.relay_id,
                info=RegisterInfo(params=self.table, region=self.region),
                last_submission_id=last_submission,
            )
        except ServerError as exc:  # another model (409 params_mismatch), a bad token (401)
            self.last_error = f"register: {exc}"
            raise RelayRefused(f"the upstream {self.url} refused the relay: {exc}") from exc
        reply = Registered.from_json(raw)
        self._told_region = self.region
        if reply.mode != "sync":
            self.last_error = f"the upstream runs in {reply.mode} mode"
            raise RelayRefused(
                f"the upstream {self.url} runs in {reply.mode} mode; a relay needs a sync "
                "parameter server upstream"
            )
        if reply.codecs and self.codec not in reply.codecs:
            self.last_error = f"the upstream does not take {self.codec}"
            raise RelayRefused(
                f"the upstream takes {', '.join(reply.codecs)}, not the relay's "
                f"--upstream-codec {self.codec}"
            )
        return reply

    def seed(self, params: Params) -> tuple[int, Params] | None:
        """Offer the relay's first parameters as the upstream's; None if taken, else the
        parameters the upstream already had (another relay or worker was first)."""
        try:
            reply = self.retrying(
                "initial params", lambda: self.client.upload_initial(self.relay_id, params)
            )
        except Conflict:
            return self.fetch(0)
        self.round = ParamsSeeded.from_json(reply).round or 0
        return None

    def fetch(self, min_round: int) -> tuple[int, Params]:
        """The upstream's parameters of ``min_round`` or newer (a long poll, repeated)."""
        before = self.client.bytes_down

        def get() -> tuple[int, Params]:
            try:
                return self.client.get_global_params(min_round=min_round, worker_id=self.relay_id)
            except UnknownWorker:
                self.register()
                raise Unreachable("registered again") from None

        round_, params = self.retrying("download", get)
        self.round = round_
        self.last_download_bytes = self.client.bytes_down - before
        return round_, params

    def heartbeat(self) -> None:
        try:
            self.client.heartbeat(self.relay_id)
            if self._told_region != self.region:
                self.register()  # the upstream's status shows the region as registered
        except UnknownWorker:
            self.register()  # evicted, or the upstream restarted

    # --- a round --------------------------------------------------------------------------------

    def exchange(
        self,
        relay_round: int,
        base: int,
        names: Sequence[str],
        mean: Sequence[torch.Tensor],
        weight: float,
    ) -> tuple[int, Params]:
        """Hand the region's mean pseudo-gradient of ``relay_round`` to the upstream (once: a
        retry, a restart, a re-registration all send the same id, or learn it counted) and return
        the upstream's parameters of the round that holds it. ``base``: the upstream round the
        mean was computed against; ``weight``: the region's total weight, what an upstream with
        ``--weighting samples`` weights it by."""
        if self._told_region != self.region:
            self.retrying("register", self.register)  # the upstream shows the region's size
        dtype, wire = _DTYPES[self.codec]
        tensors = dict(zip(names, mean, strict=True))
        specs = [TensorSpec(n, wire, tuple(t.shape)) for n, t in tensors.items()]
        while True:
            sid = f"{self.relay_id}:{relay_round}:{base}"
            if self.at is not None:
                self.at("upload", sid)
            produce = lambda s: tensors[s.name].to(dtype)  # noqa: E731
            counted, base = self._upload(sid, base, specs, produce, weight)
            if counted is not None:
                self.uploads += 1
                if self.at is not None:
                    self.at("counted", sid)
                return self.fetch(counted + 1)

    def _upload(
        self,
        sid: str,
        base: int,
        specs: list[TensorSpec],
        produce: Callable[[TensorSpec], torch.Tensor],
        weight: float,
    ) -> tuple[int | None, int]:
        """One upload: (the upstream round it counted in, or None; the base to send it on next)."""
        sent = self.client.bytes_up
        try:
            raw = self.retrying(
                "submit",
                lambda: self.client.submit_pseudogradients(
                    self.relay_id, base, sid, specs, produce, weight=weight
                ),
            )
        except UnknownWorker:
            last = self.retrying("register", lambda: self.register(sid)).last_submission
            if last is not None and last.counted_in is not None:
                return last.counted_in, base
            return None, base  # the upstream lost it (or never had it): send it again
        except Conflict as exc:
            now = exc.reply.round if exc.reply.round is not None else base
            action = exc.reply.action
            log.info("relay: upstream answered %s (%s)", exc.code, action)
            if action == "retry":
                self.stopping.wait(RETRY_S)
                return None, base
            # The upstream moved on without this upload (rebase), or counts the relay from its
            # next round (continue, wait): send the same mean on the round to come. Its id then
            # names that base, so it is a new submission, counted once.
            if action == "rebase" and exc.code != "round_closing":
                return None, now  # the upstream's open round
            self.fetch(now + 1)  # the long poll waits until that round opens
            return None, now + 1
        finally:
            self.last_upload_bytes = self.client.bytes_up - sent or self.last_upload_bytes
        receipt = UploadReceipt.from_json(raw)
        log.info("relay: upload %s %s in upstream round %s", sid, receipt.status, receipt.round)
        return receipt.round, base
