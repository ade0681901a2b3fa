"""DiLoCoClient: the worker's side of the HTTP protocol, with timeouts and retries on every call."""

from __future__ import annotations

import http.client
import json
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests
import torch
import urllib3

from diloco.wire import (
    Layout,
    TensorSpec,
    WireError,
    build_layout,
    iter_body,
    read_layout,
    readinto_payload,
    spec_of,
)
from diloco.wire.decode import tensor_views
from diloco.wire.encode import byte_view
from diloco.wire.messages import (
    Deregister,
    ErrorBody,
    Heartbeat,
    QuorumAsk,
    QuorumOutcome,
    Register,
    RegisterInfo,
    Table,
    UploadMeta,
)
from diloco.wire.messages.quorums import ERROR_LIMIT
from diloco.wire.messages.registration import SwarmBeat
from diloco.wire.messages.rendezvous import StoreCall
from diloco.wire.messages.swarm import PATH as SWARM
from diloco.wire.messages.swarm import REASON_LIMIT, StageReady, SuspectReport
from diloco.worker.transport.address import server_url
from diloco.worker.transport.bulk import BulkConnections

log = logging.getLogger(__name__)

#: Sent on every request. A browser adds a custom header to a cross-site request only after a
#: CORS preflight the server never grants, so the server refuses state-changing requests
#: without it: a hostile web page cannot forge one.
CLIENT_HEADER = "X-Diloco-Client"


class ServerError(Exception):
    """The server answered with an error status. ``body`` is its JSON reply as it came,
    ``reply`` the same read as an ``ErrorBody`` (``code`` and ``detail`` are its fields)."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        self.status = status
        self.body = dict(body)
        self.reply = ErrorBody.of(self.body)
        self.code = self.reply.error
        self.detail = self.reply.detail
        super().__init__(f"HTTP {status} {self.code}: {self.detail}")


class UnknownWorker(ServerError):
    """410: the server does not know this worker (evicted, or restarted); register again."""


class Conflict(ServerError):
    """409: the submission does not fit the current round; ``reply.action`` says what to do."""


class Unreachable(Exception):
    """The server could not be reached after every retry."""


#: What a sync survives: it is logged, counted and tried again later; training goes on.
SYNC_FAILURES = (Unreachable, ServerError, WireError)


#: The most bytes of a JSON reply read on a bulk connection (upload replies, errors, "pending").
MAX_JSON_REPLY = 1 << 20


@dataclass(frozen=True)
class Download:
    round: int
    instance: str
    layout: Layout
    nbytes: int


def _raw_codec(specs: Iterable[TensorSpec]) -> dict[str, str]:
    """The metadata of a raw body: the codec its tensors' one dtype amounts to."""
    dtypes = {s.dtype for s in specs}
    return (
        {"codec": "bf16"} if dtypes == {"BF16"} else {"codec": "fp32"} if dtypes == {"F32"} else {}
    )


def _error_for(status: int, body: Mapping[str, Any]) -> ServerError:
    if status == 410:
        return UnknownWorker(status, body)
    if status == 409:
        return Conflict(status, body)
    return ServerError(status, body)


def _reply_or_raise(status: int, raw: bytes) -> dict[str, Any]:
    """A JSON object reply, or the error it carries raised."""
    try:
        body = json.loads(raw)
    except ValueError:  # also UnicodeDecodeError
        body = {"error": "bad_reply", "detail": raw[:200].decode("utf-8", "replace")}
    if not isinstance(body, dict):
        body = {"error": "bad_reply", "detail": str(body)[:200]}
    if status >= 400:
        raise _error_for(status, body)
    return body


# Statuses worth retrying: the server is up but cannot answer usefully yet, or (408) it gave up
# on a body that stopped arriving.
RETRY_STATUSES = frozenset({408, 502, 503, 504})
# Raised by requests, by urllib3 and http.client while a body is read, and by the socket itself
# (OSError covers a refused or reset connection, a timeout, a failed TLS handshake; requests'
# own errors derive from it too).
NETWORK_ERRORS = (
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


class DiLoCoClient:
    """Blocking client for one DiLoCo server.

    Every call has a ``(connect, read)`` timeout. Network failures and 502/503/504 are retried
    with exponential backoff and jitter, ``retries`` times; then ``Unreachable`` is raised.
    Error replies raise ``ServerError`` (``UnknownWorker`` for 410, ``Conflict`` for 409).
    """

    def __init__(
        self,
        server_addr: str,
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        verify: bool | str = True,
        tls_ca: str | None = None,
    ) -> None:
        self.base_url = server_url(server_addr)  # ``localhost``: the default port
        self.timeout = (connect_timeout, read_timeout)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        # TLS certificates are verified: against ``tls_ca`` (a private CA or a self-signed
        # certificate) when given, else against the system's authorities.
        self._verify = tls_ca if tls_ca else verify
        # One session per thread: requests.Session is not documented as thread-safe, and a
        # heartbeat must not wait behind a long poll.
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self.retry_count = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._rng = random.Random()
        # Sent on every request, by the requests sessions and the bulk connections alike.
        self._headers = {CLIENT_HEADER: "worker"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._bulk = BulkConnections(
            self.base_url,
            headers=self._headers,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            verify=self._verify,
        )

    @property
    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.verify = self._verify
            session.trust_env = False  # an environment proxy must not see tensors or tokens
            session.headers.update(self._headers)
            self._local.session = session
            self._sessions.append(session)
        return session

    def close(self) -> None:
        for session in self._sessions:
            session.close()
        self._bulk.close()

    def end_thread(self) -> None:
        """The calling thread makes no more calls: close its session now (a short-lived
        thread, as a quorum's joining thread, would otherwise leave one open per round)."""
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            return
        self._local.session = None
        self._sessions.remove(session)
        session.close()

    # --- plumbing -----------------------------------------------------------------------------

    def _sleep_before(self, attempt: int) -> None:
        delay = min(self.max_backoff, self.backoff * 2**attempt)
        time.sleep(delay * (0.5 + self._rng.random() / 2))

    def _with_retries(self, what: str, call: Callable[[], Any], retries: int | None = None) -> Any:
        last: BaseException | None = None
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                self.retry_count += 1
                self._sleep_before(attempt - 1)
            try:
                return call()
            except NETWORK_ERRORS as exc:
                last = exc
                # With no retry the caller gets the error and says it; a warning would say it
                # twice (``diloco status`` against a server that is not running).
                log.log(
                    logging.WARNING if retries else logging.DEBUG,
                    "%s: attempt %d/%d failed: %s",
                    what,
                    attempt + 1,
                    retries + 1,
                    exc,
                )
            except ServerError as exc:
                if exc.status not in RETRY_STATUSES:
                    raise
                last = exc
                log.warning("%s: attempt %d/%d: %s", what, attempt + 1, retries + 1, exc)
            except WireError as exc:
                if exc.code != "truncated":
                    raise
                last = exc  # the connection dropped mid-body
                log.warning("%s: attempt %d/%d: %s", what, attempt + 1, retries + 1, exc)
        raise Unreachable(
            f"{what}: {self.base_url} unreachable after {retries + 1} attempts: {last}"
        ) from last

    @staticmethod
    def _json_or_raise(resp: requests.Response) -> dict[str, Any]:
        return _reply_or_raise(resp.status_code, resp.content)

    def _json(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        _retries: int | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            resp = self._session.request(
                method, self.base_url + path, json=body, params=params or None, timeout=self.timeout
            )
            return self._json_or_raise(resp)

        return self._with_retries(f"{method} {path}", call, _retries)

    # --- JSON endpoints -----------------------------------------------------------------------
    # Bodies are built by their message classes (``diloco.wire.messages``); replies come back as
    # the JSON objects the server sent, which the worker reads with the reply classes.

    def register(
        self,
        worker_id: str | None = None,
        *,
        hostname: str | None = None,
        info: RegisterInfo | Mapping[str, Any] | None = None,
        last_submission_id: str | None = None,
    ) -> dict[str, Any]:
        """``Register``; the reply is a ``Registered``. ``info`` given as a mapping is checked
        as a ``RegisterInfo`` (``MessageError`` before anything is sent)."""
        body = Register(
            worker_id=worker_id or None,
            hostname=hostname or socket.gethostname(),
            info=info if isinstance(info, RegisterInfo) else RegisterInfo.from_json(info or {}),
            last_submission_id=last_submission_id or None,
        )
        return self._json("POST", "/register", body.to_json())

    def heartbeat(
        self,
        worker_id: str,
        *,
        steps_per_second: float | None = None,
        loss: float | None = None,
        step_age_s: float | None = None,
        syncing: bool | None = None,
        swarm: SwarmBeat | None = None,
    ) -> dict[str, Any]:
        """``Heartbeat``: liveness plus what the status page shows. ``step_age_s`` (seconds since
        the training loop's last optimizer step) and ``syncing`` let the server tell a hung loop
        from a busy one; ``swarm``: a swarm peer's measurements. The reply is a
        ``HeartbeatReply``."""
        # A loss that is not finite is left out (as in an upload's metadata): the server refuses
        # one, and a diverged worker must stay a member for the quorum's checks to leave out.
        finite = loss if loss is not None and math.isfinite(loss) else None
        body = Heartbeat(worker_id, steps_per_second, finite, step_age_s, syncing, swarm)
        return self._json("POST", "/heartbeat", body.to_json())

    def stage_ready(
        self,
        worker_id: str,
        *,
        stage: int,
        params: Table,
        address: str,
        state: tuple[int, str] | None = None,
    ) -> dict[str, Any]:
        """Swarm mode: the peer's stage service listens at ``address`` and holds ``params``
        and, with stage sync, the stage's ``state`` (round, hash) (``StageReady``; the reply is
        a ``StageAccepted``, a ``Conflict`` for another stage's table, another stage than the
        one assigned, or a state the stage did not agree on)."""
        round_, state_hash = state if state is not None else (None, None)
        body = StageReady(worker_id, stage, params, address, round=round_, state_hash=state_hash)
        return self._json("POST", f"{SWARM}/ready", body.to_json())

    def routes(self, version: int = -1) -> dict[str, Any]:
        """Swarm mode: the route table (a ``RouteTable``). A long poll: answered at once when
        ``version`` is not the table's, else on its next change or after the server's
        ``poll_timeout`` (the same version again): the read timeout must outlast that."""
        return self._json("GET", f"{SWARM}/routes", version=version)

    def suspect(
        self, worker_id: str, *, suspect: str, stage: int, reason: str = ""
    ) -> dict[str, Any]:
        """Swarm mode: a call to replica ``suspect`` of ``stage`` failed (``SuspectReport``;
        the reply is a ``SuspectNoted``). One attempt: a report that does not arrive only
        leaves the replica in the others' tables until the coordinator's own checks drop it,
        and a driver must not wait on it."""
        body = SuspectReport(worker_id, suspect, stage, reason[:REASON_LIMIT])
        return self._json("POST", f"{SWARM}/suspect", body.to_json(), _retries=0)

    def quorum(
        self, worker_id: str, *, round: int, hash: str, weight: float | None = None
    ) -> dict[str, Any]:
        """All-reduce mode: ask for this round's quorum (``QuorumAsk``), presenting the state
        held (``hash`` empty: none the worker can vouch for) and the weight it would contribute.
        A long poll: an ``Assignment``, or ``Pending`` when the server's wait ended first
        (``messages.quorum_reply`` tells them apart)."""
        body = QuorumAsk(worker_id, round, hash, has_state=bool(hash), weight=weight)
        return self._json("POST", "/quorum", body.to_json())

    def quorum_outcome(
        self,
        worker_id: str,
        quorum_id: str,
        *,
        ok: bool,
        round: int | None = None,
        hash: str = "",
        error: str = "",
        stage: str = "",
        excluded: Sequence[str] = (),
    ) -> dict[str, Any]:
        """All-reduce mode: how quorum ``quorum_id``'s round ended here (``QuorumOutcome``;
        the reply is an ``OutcomeRecorded``): when not ok, where (``stage``) and why; either
        way the members its checks left out (``excluded``)."""
        body = (
            QuorumOutcome(worker_id, quorum_id, ok, round, hash, excluded=tuple(excluded))
            if ok
            else QuorumOutcome(
                worker_id,
                quorum_id,
                ok,
                error=error[:ERROR_LIMIT],
                stage=stage,
                excluded=tuple(excluded),
            )
        )
        return self._json("POST", "/quorum/outcome", body.to_json())

    def rendezvous(self, path: str, op: str, body: StoreCall) -> dict[str, Any]:
        """All-reduce mode: one call on a quorum's rendezvous keys (``POST <path>/<op>``,
        ``messages/rendezvous.py``), with this client's token, TLS and timeouts. A wait in
        ``body`` must end within the read timeout. One attempt, no retries: the keys live in the
        server process, so a server that cannot be reached has lost the quorum (a restarted one
        never knew it); retrying would only hold the member away from registering again."""
        return self._json("POST", f"{path}/{op}", body.to_json(), _retries=0)

    def deregister(self, worker_id: str) -> dict[str, Any]:
        """``Deregister``; the reply is a ``Deregistered``."""
        return self._json("POST", "/deregister", Deregister(worker_id).to_json())

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/status")

    # --- tensor endpoints ---------------------------------------------------------------------

    def _post_tensors(
        self,
        what: str,
        path: str,
        layout: Layout,
        produce: Callable[[TensorSpec], torch.Tensor | Iterable[torch.Tensor]],
        **params: Any,
    ) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            status, raw = self._bulk.post(
                path, params, layout.total_size, iter_body(layout, produce), MAX_JSON_REPLY
            )
            reply = _reply_or_raise(status, raw)
            self.bytes_up += layout.total_size
            return reply

        return self._with_retries(what, call)

    def submit_pseudogradients(
        self,
        worker_id: str,
        base_round: int,
        submission_id: str,
        specs: list[TensorSpec],
        produce: Callable[[TensorSpec], torch.Tensor | Iterable[torch.Tensor]],
        *,
        weight: float = 1.0,
        tokens: float | None = None,
        fragment: int | None = None,
        loss: float | None = None,
        steps: int | None = None,
        codec: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Stream a pseudo-gradient computed tensor by tensor by ``produce``. A retry resends
        the same submission id, so the server counts it at most once. With ``fragment``, the
        specs are that fragment's pieces (streaming DiLoCo) and ``base_round`` its round.
        ``weight``: the samples (or steps) it represents; ``tokens``: the tokens, when counted.
        ``loss`` (the last reported) and ``steps`` (inner steps so far) go in the metadata for
        the server's loss history; a loss that is not finite is left out. ``codec``: the
        ``codec_metadata`` of the codec the specs are parts of (``{"codec": "int8", ...}``);
        the body then keeps the specs' order (each tensor's parts together). None: raw fp32
        or bf16 tensors, named by their dtype. The metadata is an ``UploadMeta``; the reply an
        ``UploadReceipt``."""
        meta = UploadMeta(
            worker_id,
            submission_id,
            base_round,
            weight,
            fragment,
            loss if loss is not None and math.isfinite(loss) else None,
            steps,
            dict(codec) if codec is not None else _raw_codec(specs),
            tokens,
        )
        layout = build_layout(specs, meta.to_metadata(), ordered=codec is not None)
        return self._post_tensors("submit", "/submit_pseudograd", layout, produce)

    def upload_initial(self, worker_id: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The initial parameters of a run that has none; the reply is a ``ParamsSeeded``."""
        layout = build_layout([spec_of(n, t) for n, t in tensors.items()], {"worker_id": worker_id})
        return self._post_tensors(
            "initial params",
            "/initial_params",
            layout,
            lambda s: tensors[s.name].detach().cpu(),
            worker_id=worker_id,
        )

    def download(
        self,
        into: Callable[[Layout], memoryview],
        *,
        min_round: int = 0,
        worker_id: str | None = None,
        fragment: int | None = None,
        on_progress: Callable[[int], None] | None = None,
        have_round: int | None = None,
    ) -> Download | None:
        """Stream the global parameters (or one fragment's pieces) into the memory
        ``into(layout)`` returns (after the caller checked the layout). None when the server's
        long poll ended before ``min_round`` (the fragment's round when ``fragment`` is given).
        ``on_progress(n)``: the first ``n`` bytes of that memory are final (see
        ``readinto_payload``); a retried download starts again from ``into``.
        ``have_round``: the round the caller's snapshot holds, so that a server with a
        compressed downlink may answer with that round's update (metadata ``kind: "update"``)
        instead of full parameters."""
        params: dict[str, Any] = {"min_round": min_round}
        if worker_id:
            params["worker_id"] = worker_id
        if fragment is not None:
            params["fragment"] = fragment
        if have_round is not None:
            params["have_round"] = have_round

        def call() -> Download | None:
            resp = self._bulk.get("/global_params", params)
            complete = False
            try:
                ctype = resp.getheader("Content-Type") or ""
                if resp.status != 200 or "json" in ctype:
                    raw = resp.read(MAX_JSON_REPLY)
                    complete = resp.isclosed()
                    body = _reply_or_raise(resp.status, raw)
                    if resp.status == 202:
                        return None
                    raise ServerError(resp.status, body)
                layout = read_layout(resp.read)
                readinto_payload(resp.readinto, resp.read, into(layout), on_progress)
                complete = True
            finally:
                if not complete:  # a body left half read makes the connection unusable
                    self._bulk.discard()
            meta = layout.metadata
            self.bytes_down += layout.total_size
            return Download(
                int(meta.get("round", "0")), meta.get("instance", ""), layout, layout.total_size
            )

        return self._with_retries("download", call)

    def get_global_params(
        self, *, min_round: int = 0, worker_id: str | None = None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Convenience: download into fresh tensors. Returns (round, name -> tensor)."""
        holder: dict[str, torch.Tensor] = {}

        def into(layout: Layout) -> memoryview:
            holder["payload"] = torch.empty(layout.payload_size, dtype=torch.uint8)
            return byte_view(holder["payload"])

        while True:
            got = self.download(into, min_round=min_round, worker_id=worker_id)
            if got is not None:
                return got.round, tensor_views(got.layout, holder["payload"])
