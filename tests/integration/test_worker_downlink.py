"""A compressed downlink, worker side, through a real server (issue 18): workers that receive
each round as an update stay bit-identical to ``GET /global_params`` after every round; a
snapshot that differs from the server's is caught by the round's checksum and replaced by one
full download; a server without a lossy downlink is never asked for updates."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.servers import published
from tests.helpers.threads import in_threads

ROUNDS = 4
EVERY = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def assert_bitwise(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name


@contextmanager
def one_step_worker(
    address: str, seed: int
) -> Iterator[tuple[torch.nn.Module, DiLoCoWorker, Callable[[], None]]]:
    """A worker that syncs after every step, and ``step()``: one seeded SGD step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    with DiLoCoWorker(model, opt, address, sync_every=1, heartbeat_interval=0) as w:

        def step() -> None:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)

        yield model, w, step


def train(
    address: str, rank: int, rounds: int, check: list[int], **kw: Any
) -> tuple[torch.nn.Module, dict[str, float]]:
    """``rounds`` rounds of ``EVERY`` random SGD steps; after each sync, the model is compared
    bit for bit with the published parameters (in sync mode they stay the same until this
    worker uploads again). ``check`` collects the rounds compared."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    with DiLoCoWorker(model, opt, address, sync_every=EVERY, heartbeat_interval=0, **kw) as w:
        for _ in range(rounds * EVERY):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)
            if w.local_step == 0:  # this step's hook synced
                r, params = published(address)
                assert r == w.base_round
                assert_bitwise(model, params)
                check.append(r)
        return model, dict(w.sync_metrics)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_workers_stay_bit_identical_to_the_published_parameters(codec: str) -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, download_codec=codec)) as srv:
        checked: dict[int, list[int]] = {0: [], 1: []}
        results = in_threads(
            2, lambda rank: train(srv.address, rank, ROUNDS, checked[rank]), timeout=80
        )
        final = srv.global_params()
        true = srv.global_params(true=True)
        status = srv.status()
    for rank in range(2):
        model, metrics = results[rank]
        assert checked[rank] == list(range(1, ROUNDS + 1))
        assert_bitwise(model, final)
        assert metrics["full_downloads"] == 1  # the join's
        assert metrics["update_downloads"] == ROUNDS
        assert metrics["checksum_mismatches"] == 0
        assert metrics["failed_syncs"] == 0
    assert status["update_downloads"] == 2 * ROUNDS
    # The published copy is the true one up to one round's quantization, not equal to it.
    assert any(not torch.equal(final[n], true[n]) for n in final)


@pytest.mark.timeout(60)
def test_a_snapshot_that_differs_is_caught_by_the_checksum_and_downloaded_in_full() -> None:
    config = ServerConfig(port=0, num_workers=1, download_codec="int8")
    with DiLoCoServer(config) as srv, one_step_worker(srv.address, seed=3) as (model, w, step):
        step()  # round 1, as an update
        assert w.sync_metrics["update_downloads"] == 1
        # A replica that no longer holds the server's bits (here: one element of its
        # snapshot changed, as another device's arithmetic or a lost round would).
        name = next(iter(w._local.snapshot))
        w._local.snapshot[name].view(-1)[0] += 1.0
        step()  # round 2: the update applies, the checksum differs, full parameters follow
        m = w.sync_metrics
        assert (m["checksum_mismatches"], m["full_downloads"]) == (1, 2)
        assert m["update_downloads"] == 1 and m["failed_syncs"] == 0
        assert w.base_round == 2
        assert_bitwise(model, published(srv.address)[1])
        step()  # round 3: updates again
        assert w.sync_metrics["update_downloads"] == 2
        assert w.sync_metrics["checksum_mismatches"] == 1
        assert_bitwise(model, published(srv.address)[1])


@pytest.mark.timeout(60)
def test_a_full_precision_downlink_sends_full_parameters_every_round() -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as srv:
        checked: list[int] = []
        _, metrics = train(srv.address, 0, 2, checked)
    assert checked == [1, 2]
    assert (metrics["full_downloads"], metrics["update_downloads"]) == (3, 0)


@pytest.mark.timeout(60)
def test_a_rejoining_worker_gets_full_parameters() -> None:
    config = ServerConfig(port=0, num_workers=1, download_codec="int8")
    with DiLoCoServer(config) as srv, one_step_worker(srv.address, seed=4) as (model, w, step):
        step()
        assert (w.sync_metrics["full_downloads"], w.sync_metrics["update_downloads"]) == (1, 1)
        client = DiLoCoClient(srv.address, retries=1, backoff=0.01)
        assert w.worker_id is not None
        client.deregister(w.worker_id)  # the server forgets it, as after an eviction
        client.close()
        step()  # the upload is refused as unknown: the worker re-joins, then syncs
        m = w.sync_metrics
        assert m["reconnections"] == 1
        assert m["full_downloads"] == 2 and m["checksum_mismatches"] == 0
        step()  # the progress kept through the re-join goes up; the round comes down
        assert w.sync_metrics["update_downloads"] >= 2
        assert_bitwise(model, published(srv.address)[1])
