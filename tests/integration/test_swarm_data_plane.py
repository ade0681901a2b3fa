"""The swarm's data plane against the unsplit model (issue 29): stage services on 127.0.0.1
port 0 in threads, a driver in the test's thread, the plain training loop as the spec."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from diloco.swarm import BoundaryCodec, Driver, Endpoint, StageCallError, StaticRoutes
from diloco.swarm.routing import NoReplica
from tests.helpers.swarm import (
    HIDDEN,
    NthForward,
    batches,
    joined,
    make_model,
    make_optimizer,
    reference,
    swarm,
)

STEPS = 5


def _assert_params(got: dict[str, torch.Tensor], model: torch.nn.Module, exact: bool) -> None:
    want = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, p in want.items():
        if exact:
            assert torch.equal(got[name], p), name
        else:
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_fp32_one_micro_batch_is_bit_identical_to_the_unsplit_model() -> None:
    """fp32 boundaries, one replica per stage, one micro-batch a step: the same operations in
    the same order as the unsplit model's loop, so the same bits, losses included."""
    data = batches(STEPS, 16)
    model = make_model()
    want = reference(model, data)
    with swarm() as s:
        got = [s.driver.train_step(x, y) for x, y in data]
        assert got == want
        _assert_params(joined(s), model, exact=True)
        assert [g[0].stats()["steps"] for g in s.services.values()] == [STEPS, STEPS]


def test_micro_batches_match_the_unsplit_model_to_float_tolerance() -> None:
    """Four micro-batches a step, one or four in flight: each micro-batch's mean loss is scaled
    by its share of the batch and the gradients add up across micro-batches, which is the
    batch's gradient in exact arithmetic but rounds differently from one mean over the batch
    (and, in flight, the gradients arrive in any order): equal to float tolerance, not bits."""
    data = batches(STEPS, 16)
    model = make_model()
    want = reference(model, data)
    for in_flight in (1, 4):
        with swarm(micro_batch=4, max_in_flight=in_flight) as s:
            got = [s.driver.train_step(x, y) for x, y in data]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            _assert_params(joined(s), make_model_after(data), exact=False)
            assert s.driver.stats()["micro_batches"] == 4 * STEPS
            assert [g[0].stats()["steps"] for g in s.services.values()] == [STEPS, STEPS]


def make_model_after(data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.nn.Module:
    model = make_model()
    reference(model, data)
    return model


def test_int8_boundaries_train_like_fp32_at_hidden_plus_2_bytes_per_token() -> None:
    """int8 with one bf16 scale per row costs HIDDEN + 2 payload bytes per token per boundary
    and direction (plus the body's header over the micro-batch), and after N steps the loss
    stays within 1% of the fp32 run's."""
    data = batches(20, 16)
    with swarm() as s:
        fp32 = [s.driver.train_step(x, y) for x, y in data]
    with swarm(codec="int8") as s:
        int8 = [s.driver.train_step(x, y) for x, y in data]
        traffic = s.driver.stats()["traffic"]
        spec = s.driver.boundaries[0][0].spec
    assert abs(sum(int8[-5:]) - sum(fp32[-5:])) <= 0.01 * sum(fp32[-5:])
    codec = BoundaryCodec(spec, "int8")
    body = codec.encode(torch.randn(16, HIDDEN))
    header = len(body) - 16 * (HIDDEN + 2)
    assert 0 < header < 400  # the body is the int8 codes and scales plus its header, no more
    for key in ("0->1:forward", "0->1:backward", "1->2:forward", "1->2:backward"):
        assert traffic[key]["bytes_per_token"] >= HIDDEN + 2
        if key.startswith("0->1"):  # 1->2 bodies carry the targets, or the loss, too
            assert traffic[key]["bytes_per_token"] == HIDDEN + 2 + header / 16, key


def _no_fault_run(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], dict]:
    with swarm(micro_batch=4) as s:
        losses = [s.driver.train_step(x, y) for x, y in data]
        return losses, joined(s)


@pytest.mark.parametrize(("stage", "kind"), [(1, "forward"), (2, "loss")])
def test_a_killed_replica_mid_step_loses_no_micro_batch(stage: int, kind: str) -> None:
    """Two replicas of a stage (the middle one, or the tail); the one serving the step is killed
    (server stopped, connections reset) when its 2nd call arrives, so micro-batch 0 was already
    applied there. The driver re-sends micro-batch 1 to the other replica after replaying
    micro-batch 0 on it: the run equals the no-fault run bit for bit, and the killed replica
    never stepped."""
    data = batches(3, 16)
    want_losses, want_params = _no_fault_run(data)
    fault = NthForward(2, kind)
    hooks = {(stage, r): fault.for_replica(r) for r in range(2)}
    with swarm(replicas={stage: 2}, micro_batch=4, hooks=hooks) as s:
        got: list[float] = []
        killed_at: list[float] = []

        def kill() -> None:
            assert fault.reached.wait(30)
            killed_at.append(time.monotonic())
            s.services[stage][fault.replica].stop(abrupt=True)
            fault.release()

        killer = threading.Thread(target=kill)
        killer.start()
        got.append(s.driver.train_step(*data[0]))
        recovered = time.monotonic() - killed_at[0]
        killer.join(10)
        got += [s.driver.train_step(x, y) for x, y in data[1:]]
        survivor = 1 - fault.replica
        assert got == want_losses
        params = joined(s, {stage: survivor})
        assert all(torch.equal(params[n], want_params[n]) for n in want_params)
        stats = s.driver.stats()
        assert stats["reroutes"] == 1 and stats["recoveries"] == 1
        assert s.services[stage][survivor].stats()["steps"] == 3
        assert s.services[stage][fault.replica].stats()["steps"] == 0
        assert s.routes.suspects.keys() == {s.endpoint(s.services[stage][fault.replica])}
        assert recovered < 1.0


def test_a_frozen_replica_is_left_within_the_computed_timeout() -> None:
    """The serving replica freezes inside its 2nd forward until the test releases it; the call
    times out (1 s before any latency was measured, else 4x the stage's slowest recent call,
    at least 0.5 s) and goes to the other replica: the step completes within that timeout + 1 s
    and the run equals the no-fault run. The frozen call, released late, is refused as past its
    budget: the frozen replica holds no step."""
    data = batches(3, 16)
    want_losses, want_params = _no_fault_run(data)
    freeze = NthForward(2)
    hooks = {(1, r): freeze.for_replica(r) for r in range(2)}
    with swarm(
        replicas={1: 2}, micro_batch=4, hooks=hooks, timeout_floor_s=0.5, first_timeout_s=1.0
    ) as s:
        began = time.monotonic()
        got = [s.driver.train_step(*data[0])]
        elapsed = time.monotonic() - began
        assert freeze.reached.is_set()
        (reason,) = s.routes.suspects.values()
        timeout = float(re.fullmatch(r"forward timed out after ([0-9.]+) s", reason)[1])  # type: ignore[index]
        assert 0.5 <= timeout and elapsed < timeout + 1.0
        freeze.release()
        s.services[1][freeze.replica].drain()
        assert s.services[1][freeze.replica].stats()["refused"] == 1  # 503 late
        got += [s.driver.train_step(x, y) for x, y in data[1:]]
        survivor = 1 - freeze.replica
        assert got == want_losses
        params = joined(s, {1: survivor})
        assert all(torch.equal(params[n], want_params[n]) for n in want_params)
        assert s.driver.stats()["reroutes"] == 1
        assert s.services[1][freeze.replica].stats()["steps"] == 0
        assert s.services[1][survivor].stats()["steps"] == 3


def test_a_backward_whose_forward_expired_is_preceded_by_the_forward_again() -> None:
    """The middle stage's clock jumps past the call TTL while the tail computes the first loss:
    the held forward expires, the backward gets 404 ``unknown_call``, and the driver forwards the
    kept input there again, then backward. Same parameters, same result: bit-identical."""
    data = batches(2, 16)
    model = make_model()
    want = reference(model, data)
    now = [0.0]
    jumped = threading.Event()

    def jump(kind: str, call: str) -> None:
        if not jumped.is_set():
            jumped.set()
            now[0] += 1000.0

    with swarm(
        hooks={(2, 0): jump}, service_options={1: {"clock": lambda: now[0], "call_ttl_s": 60.0}}
    ) as s:
        got = [s.driver.train_step(x, y) for x, y in data]
        assert jumped.is_set() and got == want
        _assert_params(joined(s), model, exact=True)
        assert s.driver.stats()["reroutes"] == 0
        stats = s.services[1][0].stats()
        assert stats["refused"] == 1 and stats["steps"] == 2  # the one 404, then the forward


def test_a_refused_step_raises_and_leaves_no_head_gradient() -> None:
    """A stage's 401 (a driver with the wrong token) is no fault another replica can fix: the
    step raises ``StageCallError`` at once, reports no suspect, and the head's gradients of the
    abandoned step are cleared so they cannot leak into the next one."""
    x, y = batches(1, 16)[0]
    with swarm() as s:
        wrong = StaticRoutes(
            {k: [Endpoint(group[0].address, "wrong")] for k, group in s.services.items()}
        )
        driver = Driver(
            s.stages[0], make_optimizer(s.stages[0]), wrong, s.driver.boundaries, micro_batch=16
        )
        with pytest.raises(StageCallError, match="401"):
            driver.train_step(x, y)
        assert all(p.grad is None for p in s.stages[0].parameters())
        assert wrong.suspects == {} and driver.stats()["reroutes"] == 0


def test_a_stage_whose_only_replica_is_suspect_waits_for_it_to_come_back() -> None:
    """One replica of the middle stage freezes in its 2nd forward past the call's timeout: the
    driver reports it suspect and, with no other replica, waits for the routes to list one
    rather than failing the step. The test restores it once the driver waits, then releases the
    frozen call (refused as late): the step completes on the same replica and the run equals
    the no-fault run; a stage that never comes back fails the step after ``replica_wait_s``."""
    data = batches(3, 16)
    want_losses, want_params = _no_fault_run(data)
    freeze = NthForward(2)
    with swarm(
        micro_batch=4, hooks={(1, 0): freeze.for_replica(0)}, timeout_floor_s=0.5,
        first_timeout_s=1.0,
    ) as s:  # fmt: skip
        waiting = threading.Event()
        wait = s.routes.wait_for_replica

        def waits(stage: int, timeout: float) -> bool:
            waiting.set()
            return wait(stage, timeout)

        s.routes.wait_for_replica = waits  # type: ignore[method-assign]
        step = threading.Thread(target=lambda: got.append(s.driver.train_step(*data[0])))
        got: list[float] = []
        step.start()
        assert waiting.wait(30), "the driver never waited for the stage"
        (endpoint,) = s.routes.suspects
        s.routes.restore(endpoint)
        freeze.release()
        step.join(30)
        assert not step.is_alive() and len(got) == 1
        got += [s.driver.train_step(x, y) for x, y in data[1:]]
        assert got == want_losses
        params = joined(s)
        assert all(torch.equal(params[n], want_params[n]) for n in want_params)
        assert s.services[1][0].stats()["refused"] >= 1  # the frozen call, released late
        # Never back: the step fails after the wait, not forever.
        s.driver.replica_wait_s = 0.2
        s.routes.suspect(endpoint, "test: gone")
        with pytest.raises(NoReplica):
            s.driver.train_step(*data[0])
