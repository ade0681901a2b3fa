"""Driver: a head replica's side of the swarm. It runs the head stage locally and pushes each
step's micro-batches through the remote stages, head to tail and back.

Per micro-batch: head forward (local), ``forward`` on each body stage, ``loss`` on the tail,
``backward`` back through the bodies, head backward (local). Up to ``max_in_flight``
micro-batches run at once (threads; the head's autograd is serialized by a lock). The head's
optimizer steps once the step's micro-batches are all back; the remote stages step by
themselves when their samples are in (``stage_service.py``).

Routing, per step: one replica per remote stage, sticky for the step, picked from the routes
weighted by measured throughput (``routing.Picker``).

Failover, per stage call: a connection reset, a refusal (5xx, 408, 429) or a timeout (from the
stage's recent latency, at least ``timeout_floor_s``) reports the endpoint suspect and re-sends
the ONE call to another replica from the input the driver kept. The new replica first gets a
replay of the step's micro-batches this stage had already finished on the failed one (forward
then backward; ``loss`` on the tail), so its step holds every micro-batch of the step: none is
lost, and since each replica answers a repeated call id from its table, none is counted twice
by any one replica. A backward sent to a replica that does not hold its forward (404
``unknown_call``: dropped, expired, or never seen) is preceded by that forward again.

Busy replicas: a 503 ``syncing`` (the replica is stepping, perhaps through a stage sync's quorum
round) is not a failure: the driver waits the reply's ``retry_after`` and sends the same call to
the same replica again, for at most ``busy_wait_s`` in all (a peer sets it to its stage's
collective timeout), and only then treats the replica as failed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import requests
import torch
from torch import nn

from diloco.swarm.boundary import BoundaryCodec, Meter
from diloco.swarm.routing import Endpoint, NoReplica, Picker, Routes
from diloco.swarm.stage_service import PREFIX

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
"""Calls of one stage call, re-sends included, before the step fails: failover tries each
replica at most once per failure, so this bounds a step's wait when all of them are gone."""


class CallFailed(Exception):
    """A stage call failed in a way another replica may not (reset, refusal, timeout)."""


class UnknownCall(Exception):
    """The replica does not hold the call's forward (404 ``unknown_call``)."""


class StageCallError(RuntimeError):
    """A stage refused a call for a reason re-sending cannot fix (400, 401, 409, 413): the
    driver's own settings or data are wrong. ``status`` and ``body`` are the reply's."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


@dataclass
class _Record:
    """What a stage finished for one micro-batch, kept to replay it on another replica."""

    index: int
    inp: torch.Tensor
    samples: int
    grad: torch.Tensor | None = None  # body stages: the gradient of the output
    targets: torch.Tensor | None = None  # the tail
    scale: float = 1.0


@dataclass
class _Step:
    number: int
    picks: dict[int, Endpoint]
    done: dict[int, list[_Record]] = field(default_factory=dict)
    holder: dict[tuple[int, int], Endpoint] = field(default_factory=dict)
    locks: dict[int, threading.Lock] = field(default_factory=dict)


class Driver:
    """Drives micro-batches through a swarm from a head replica.

    ``boundaries[b]`` is the ``(forward, backward)`` codec pair between stage ``b`` and
    ``b + 1`` (so ``len(boundaries) == num_stages - 1``); ``routes`` names the replicas of
    stages ``1..num_stages-1``."""

    def __init__(
        self,
        head: nn.Module,
        head_optimizer: torch.optim.Optimizer,
        routes: Routes,
        boundaries: list[tuple[BoundaryCodec, BoundaryCodec]],
        *,
        micro_batch: int,
        max_in_flight: int = 1,
        timeout_floor_s: float = 1.0,
        first_timeout_s: float = 30.0,
        token_dims: int = 1,
        driver_id: str = "driver",
        seed: int = 0,
        busy_wait_s: float = 60.0,
        replica_wait_s: float = 60.0,
        tls_ca: str | None = None,
    ) -> None:
        if len(boundaries) < 1:
            raise ValueError("a swarm has at least two stages: one boundary")
        if micro_batch < 1 or max_in_flight < 1:
            raise ValueError("micro_batch and max_in_flight must be at least 1")
        self.head, self.head_optimizer, self.routes = head, head_optimizer, routes
        self.boundaries = boundaries
        self.num_stages = len(boundaries) + 1
        self.micro_batch, self.max_in_flight = micro_batch, max_in_flight
        self.token_dims, self.driver_id = token_dims, driver_id
        self.busy_wait_s = busy_wait_s
        #: A PEM bundle that verifies the stage services' certificates (``https`` endpoints
        #: signed by a private CA); None: the system's trust store. Never unverified.
        self.tls_ca = tls_ca
        #: How long a call waits for a stage with no live replica left (its only replica
        #: suspect or gone: the routes may list it again, or another may join) before the step
        #: fails.
        self.replica_wait_s = replica_wait_s
        self.picker = Picker(
            seed=seed, timeout_floor_s=timeout_floor_s, first_timeout_s=first_timeout_s
        )
        self._head_lock = threading.Lock()
        self._lock = threading.Lock()  # counters and traffic
        self._counts = {
            "steps": 0, "micro_batches": 0, "reroutes": 0, "recoveries": 0, "busy_waits": 0
        }  # fmt: skip
        self._meter = Meter(self.token_dims)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_in_flight) if max_in_flight > 1 else None
        self._step_number = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # --- a step --------------------------------------------------------------------------------

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step on the batch ``(x, y)``: returns its mean loss (the micro-batches' losses,
        each scaled by its share of the batch, summed)."""
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(f"batch of {x.shape[0]} inputs and {y.shape[0]} targets")
        picks = {k: self._pick(k) for k in range(1, self.num_stages)}
        step = _Step(self._step_number, picks)
        step.locks = {k: threading.Lock() for k in picks}
        step.done = {k: [] for k in picks}
        total = x.shape[0]
        chunks = list(
            zip(torch.split(x, self.micro_batch), torch.split(y, self.micro_batch), strict=True)
        )
        jobs = [(i, xb, yb, xb.shape[0] / total) for i, (xb, yb) in enumerate(chunks)]
        try:
            if self._pool is None:
                losses = [self._micro_batch(step, *job) for job in jobs]
            else:
                losses = list(self._pool.map(lambda job: self._micro_batch(step, *job), jobs))
        except BaseException:
            # The step is abandoned: the head's gradients of its finished micro-batches must not
            # leak into the next step. (Remote stages keep theirs: docs/design/swarm.md.)
            self.head_optimizer.zero_grad()
            raise
        self.head_optimizer.step()
        self.head_optimizer.zero_grad()
        self._step_number += 1
        with self._lock:
            self._counts["steps"] += 1
            self._counts["micro_batches"] += len(jobs)
        return float(sum(losses))

    def _pick(self, k: int) -> Endpoint:
        """A replica of stage ``k``; with none live, waits up to ``replica_wait_s`` for the
        routes to list one (``NoReplica`` past it)."""
        try:
            return self.picker.pick(self.routes.endpoints(k), k)
        except NoReplica:
            log.warning(
                "stage %d has no live replica: waiting up to %.0f s", k, self.replica_wait_s
            )
            if not self.routes.wait_for_replica(k, self.replica_wait_s):
                raise
            return self.picker.pick(self.routes.endpoints(k), k)

    def _micro_batch(
        self, step: _Step, i: int, xb: torch.Tensor, yb: torch.Tensor, scale: float
    ) -> float:
        with self._head_lock:
            h = self.head(xb)
        a = h.detach()
        inputs: dict[int, torch.Tensor] = {}
        for k in range(1, self.num_stages - 1):
            inputs[k] = a
            a = self._on_stage(step, k, partial(self._forward, step, k, i, a))
        tail = self.num_stages - 1
        record = _Record(i, a, xb.shape[0], targets=yb, scale=scale)
        loss, g = self._on_stage(step, tail, partial(self._loss, step, record), record)
        for k in range(self.num_stages - 2, 0, -1):
            record = _Record(i, inputs[k], xb.shape[0], grad=g)
            g = self._on_stage(step, k, partial(self._backward, step, k, record), record)
        with self._head_lock:
            h.backward(g)
        return loss

    def _on_stage(
        self, step: _Step, k: int, call: Callable[[Endpoint], Any], record: _Record | None = None
    ) -> Any:
        """``call(endpoint)`` on stage ``k``'s pick, failing over until it succeeds. With a
        ``record`` (a finished backward or loss), the record joins the step's replay list of
        the replica that applied it, or, if the stage moved to another replica meanwhile, the
        call is made again there."""
        for _ in range(MAX_ATTEMPTS):
            with step.locks[k]:
                ep = step.picks[k]
            try:
                result = call(ep)
            except CallFailed as exc:
                self._fail_over(step, k, ep, str(exc))
                continue
            if record is None:
                return result
            with step.locks[k]:
                if step.picks[k] == ep:
                    step.done[k].append(record)
                    return result
            # The stage failed over while this call ran: the new replica lacks it.
        raise NoReplica(f"stage {k}: no replica answered in {MAX_ATTEMPTS} attempts")

    def _fail_over(self, step: _Step, k: int, failed: Endpoint, reason: str) -> None:
        with step.locks[k]:
            self.routes.suspect(failed, reason)
            with self._lock:
                self._counts["reroutes"] += 1
            log.warning("stage %d replica %s failed (%s); failing over", k, failed.url, reason)
            if step.picks[k] != failed:
                return  # another micro-batch already moved the stage
            for _ in range(MAX_ATTEMPTS):
                new = self._pick(k)
                try:
                    for record in step.done[k]:
                        self._replay(step, k, record, new)
                except CallFailed as exc:
                    self.routes.suspect(new, str(exc))
                    continue
                step.picks[k] = new
                return
            raise NoReplica(f"stage {k}: no replica took the step's replay")

    def _replay(self, step: _Step, k: int, record: _Record, ep: Endpoint) -> None:
        if k == self.num_stages - 1:
            self._loss(step, record, ep)
        else:
            self._backward(step, k, record, ep)
        with self._lock:
            self._counts["recoveries"] += 1

    # --- the calls -----------------------------------------------------------------------------

    def _call_id(self, step: _Step, i: int, k: int) -> str:
        return f"{self.driver_id}.{step.number}.{i}.{k}"

    def _forward(self, step: _Step, k: int, i: int, a: torch.Tensor, ep: Endpoint) -> torch.Tensor:
        fwd_in, fwd_out = self.boundaries[k - 1][0], self.boundaries[k][0]
        body = self._meter.encode(fwd_in, "forward", a)
        reply = self._post(ep, k, "forward", self._call_id(step, i, k), a.shape[0], body)
        out, _ = fwd_out.decode(reply)
        self._meter.count(fwd_out, "forward", len(reply), out.shape)
        step.holder[(k, i)] = ep
        return out

    def _backward(self, step: _Step, k: int, record: _Record, ep: Endpoint) -> torch.Tensor:
        assert record.grad is not None
        if step.holder.get((k, record.index)) != ep:
            self._forward(step, k, record.index, record.inp, ep)
        bwd_out, bwd_in = self.boundaries[k][1], self.boundaries[k - 1][1]
        call = self._call_id(step, record.index, k)
        body = self._meter.encode(bwd_out, "backward", record.grad)
        try:
            reply = self._post(ep, k, "backward", call, record.samples, body)
        except UnknownCall:  # dropped or expired there: forward again, then backward
            self._forward(step, k, record.index, record.inp, ep)
            try:
                reply = self._post(ep, k, "backward", call, record.samples, body)
            except UnknownCall:  # dropped again at once: too busy to keep a call, go elsewhere
                raise CallFailed(f"backward: replica keeps dropping call {call}") from None
        g, _ = bwd_in.decode(reply)
        self._meter.count(bwd_in, "backward", len(reply), g.shape)
        return g

    def _loss(self, step: _Step, record: _Record, ep: Endpoint) -> tuple[float, torch.Tensor]:
        assert record.targets is not None
        k = self.num_stages - 1
        fwd_in, bwd_in = self.boundaries[k - 1]
        body = self._meter.encode(fwd_in, "forward", record.inp, {"targets": record.targets})
        reply = self._post(
            ep,
            k,
            "loss",
            self._call_id(step, record.index, k),
            record.samples,
            body,
            scale=record.scale,
        )
        g, extras = bwd_in.decode(reply, ("loss",))
        self._meter.count(bwd_in, "backward", len(reply), g.shape)
        return float(extras["loss"]), g

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _post(
        self,
        ep: Endpoint,
        k: int,
        kind: str,
        call: str,
        samples: int,
        body: bytes,
        scale: float | None = None,
    ) -> bytes:
        timeout = self.picker.timeout(k)
        params: dict[str, Any] = {"call": call, "budget": f"{timeout / 2:.3f}"}
        if kind != "backward":
            params["samples"] = samples
        if scale is not None:
            params["scale"] = repr(scale)
        headers = {"Content-Type": "application/octet-stream"}
        if ep.token is not None:
            headers["Authorization"] = f"Bearer {ep.token}"
        give_up = time.monotonic() + self.busy_wait_s
        while True:
            began = time.monotonic()
            try:
                r = self._session().post(
                    ep.url + PREFIX + kind,
                    params=params,
                    data=body,
                    headers=headers,
                    timeout=(timeout, timeout),
                    # Per request: requests lets REQUESTS_CA_BUNDLE override a session's verify.
                    verify=self.tls_ca if self.tls_ca is not None else True,
                )
            except requests.Timeout:
                raise CallFailed(f"{kind} timed out after {timeout:.2f} s") from None
            except requests.exceptions.SSLError as exc:
                # Said in full: a certificate the driver does not trust is an operator's fix
                # (tls_ca), not a flaky link.
                raise CallFailed(f"{kind}: TLS failed ({str(exc)[-200:]})") from None
            except requests.ConnectionError as exc:
                raise CallFailed(f"{kind}: connection failed ({type(exc).__name__})") from None
            wait = _busy_for(r)
            if wait is None:
                break
            if time.monotonic() + wait > give_up:
                raise CallFailed(f"{kind}: replica busy (syncing) past {self.busy_wait_s} s")
            with self._lock:
                self._counts["busy_waits"] += 1
            time.sleep(wait)  # the replica said how long its step takes: back off, not fail
        if r.status_code == 404 and "unknown_call" in r.text:
            raise UnknownCall(call)
        if r.status_code >= 500 or r.status_code in (408, 429):
            raise CallFailed(f"{kind}: HTTP {r.status_code} {r.text[:200]}")
        if r.status_code != 200:
            raise StageCallError(r.status_code, r.text)
        self.picker.measured(k, ep, samples, time.monotonic() - began)
        return r.content

    # --- observation ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Steps, micro-batches, reroutes (failed calls re-sent), recoveries (finished
        micro-batches replayed on a new replica), busy waits (503 ``syncing`` waited out),
        bytes and tokens per boundary and direction (``traffic``: sent and received; ``sent``:
        sent only), and the measured throughput of each endpoint (samples per second)."""
        with self._lock:
            return {
                **self._counts,
                **self._meter.snapshot(),
                "throughput": self.picker.throughput(),
            }


def _busy_for(r: requests.Response) -> float | None:
    """Seconds to wait before asking again, for a 503 ``syncing``; None for any other reply."""
    if r.status_code != 503 or "syncing" not in r.text:
        return None
    try:
        wait = float(r.json().get("retry_after", 0.05))
    except (ValueError, AttributeError):
        wait = 0.05
    return min(max(wait, 0.001), 1.0) if math.isfinite(wait) else 0.05
