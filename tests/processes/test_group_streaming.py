"""Streaming fragments inside worker groups: the ranks of a gloo group (spawned processes) stream
one fragment at a time as ONE worker, and equal a single-process streaming worker. Rank-side
code and the references are in ``tests/programs/stream_ranks.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers import ranks
from tests.helpers.threads import in_threads
from tests.programs import stream_ranks as sr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _assert_ranks_identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("outcome", "round", "worker_id", "metrics"):
            assert x[key] == y[key], (step, key, x[key], y[key])
        for name in x["params"]:
            assert torch.equal(x["params"][name], y["params"][name]), (step, name)


def _at(step: int, name: str) -> Callable[[str], str]:
    return lambda message: f"step {step}, {name}: {message}"


def _assert_as_reference(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Step by step: the same counts, and the parameters equal up to float rounding (DDP's
    mean of gradients against the mean loss's gradient)."""
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert {k: g["metrics"][k] for k in sr.COUNTED} == e["metrics"], step
        for name, value in g["params"].items():
            torch.testing.assert_close(value, e["params"][name], msg=_at(step, name))


@pytest.mark.parametrize(("fragments", "tau"), [(2, 1), (4, 1), (2, 0)])
def test_ddp_group_streams_as_the_single_process_reference(
    tmp_path: Path, fragments: int, tau: int
) -> None:
    """A DDP group of two ranks streaming P fragments through a real server: one registration,
    ranks bit-identical after every step (the merged fragments broadcast from rank 0), and
    every step's parameters those of a single streaming worker on the mean gradient; the
    server ends with the same parameters."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = ranks.spawn(sr.ddp_rank, (server.address, str(tmp_path), fragments, tau, False))
        ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as ref_server:
        expected_steps = sr.reference_ddp(ref_server.address, fragments, tau)
        expected = ref_server.global_params()
    assert status["registrations"] == 1
    r0, r1 = (torch.load(tmp_path / f"g0s{r}.pt") for r in range(2))
    _assert_ranks_identical(r0, r1)
    assert r0[-1]["metrics"]["fragments_sent"] == 3 * fragments  # each once per period
    assert r0[0]["outcome"] == "joined"
    assert {x["outcome"] for x in r0[1:]} <= {"joined", "adopted"}
    _assert_as_reference(r0[1:], expected_steps)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_pipeline_group_streams_as_the_unsplit_model(tmp_path: Path) -> None:
    """Two pipeline stages streaming 2 fragments: each fragment's parameters are gathered to
    rank 0 when due and scattered back at its merge; every stage's parameters equal the
    unsplit streaming worker's after every step, and so do the server's."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = ranks.spawn(sr.pipeline_rank, (server.address, str(tmp_path), 2, 1))
        ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as ref_server:
        expected_steps = sr.reference_pipeline(ref_server.address, 2, 1)
        expected = ref_server.global_params()
    assert status["registrations"] == 1
    stages = [torch.load(tmp_path / f"pipe{r}.pt") for r in range(2)]
    assert set(stages[0][-1]["params"]) == {"0.weight", "0.bias"}
    for records in stages:
        _assert_as_reference(records, expected_steps)
    assert [x["outcome"] for x in stages[0]] == [x["outcome"] for x in stages[1]]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_pipeline_group_streams_in_allreduce_mode_as_the_unsplit_model(tmp_path: Path) -> None:
    """All-reduce mode, tau 0: at each due step rank 0 gathers every stage's parameters (a
    round may move any of them) and the merge scatters each stage its own back; every stage's
    parameters equal an unsplit streaming all-reduce worker's after every step, the same
    rounds completed."""
    config = ServerConfig(port=0, num_workers=1, allreduce=True)
    with DiLoCoServer(config) as server:
        ctx = ranks.spawn(sr.pipeline_rank, (server.address, str(tmp_path), 2, 0))
        ranks.join(ctx, timeout=120)
        status = server.status()
    with DiLoCoServer(config) as ref_server:
        expected_steps = sr.reference_pipeline(ref_server.address, 2, 0)
        ref_status = ref_server.status()
    assert status["registrations"] == 1
    assert status["rounds_completed"] == ref_status["rounds_completed"] >= 5
    stages = [torch.load(tmp_path / f"pipe{r}.pt") for r in range(2)]
    assert set(stages[1][-1]["params"]) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    for records in stages:
        _assert_as_reference(records, expected_steps)
    assert [x["outcome"] for x in stages[0]] == [x["outcome"] for x in stages[1]]


def test_faults_on_rank_0_mid_fragment_leave_both_ranks_consistent(tmp_path: Path) -> None:
    """Rank 0's scripted client: the 2nd fragment upload finds the server unreachable (kept
    locally), before the 4th the server forgets the worker (410: the next due fragment
    re-joins). Both ranks see the same outcomes and metrics and hold the same bits after every
    step, and neither hangs."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = ranks.spawn(sr.ddp_rank, (server.address, str(tmp_path), 2, 1, True))
        ranks.join(ctx, timeout=120)
        status = server.status()
    r0, r1 = (torch.load(tmp_path / f"g0s{r}.pt") for r in range(2))
    _assert_ranks_identical(r0, r1)
    ranks.assert_rank0_faults_survived(r0, status)


@pytest.mark.parametrize("tau", [1, 0])
def test_ddp_group_streams_in_allreduce_mode_as_the_single_process_reference(
    tmp_path: Path, tau: int
) -> None:
    """All-reduce mode, 2 fragments: rank 0's quorum rounds run on the group's schedule, each
    round's fragment is broadcast at its merge; the ranks are bit-identical after every step
    and every step equals a single-process streaming all-reduce worker on the mean gradient."""
    config = ServerConfig(port=0, num_workers=1, allreduce=True)
    with DiLoCoServer(config) as server:
        ctx = ranks.spawn(sr.ddp_rank, (server.address, str(tmp_path), 2, tau, False))
        ranks.join(ctx, timeout=120)
        status = server.status()
    with DiLoCoServer(config) as ref_server:
        expected_steps = sr.reference_ddp(ref_server.address, 2, tau)
        ref_status = ref_server.status()
    assert status["registrations"] == 1
    assert status["rounds_completed"] == ref_status["rounds_completed"] >= 5
    r0, r1 = (torch.load(tmp_path / f"g0s{r}.pt") for r in range(2))
    _assert_ranks_identical(r0, r1)
    _assert_as_reference(r0[1:], expected_steps)


def test_streaming_still_refused_fails_on_every_rank(tmp_path: Path) -> None:
    """In all-reduce mode, a sharded group and a partitioned group asking for fragments with
    overlap_steps > 0 fail at rank 0's first registration, where the mode is learnt (rank 0's
    ValueError, which every rank raises); no hang."""
    config = ServerConfig(port=0, num_workers=1, allreduce=True)
    with DiLoCoServer(config) as one, DiLoCoServer(config) as two:
        servers = [one.address, two.address]
        ranks.join(ranks.spawn(sr.refused_rank, (servers, str(tmp_path))), timeout=60)
    errors = [torch.load(tmp_path / f"refused{r}.pt") for r in range(2)]
    assert set(errors[0]) == {"allreduce_sharded", "allreduce_partitioned"}
    for case, words in [
        ("allreduce_sharded", "sharded (DTensor) worker group in all-reduce mode need overlap"),
        ("allreduce_partitioned", "partitioned worker group (pipeline stages) in all-reduce"),
    ]:
        assert errors[0][case].startswith("ValueError: "), case
        assert words in errors[0][case]
        assert words in errors[1][case]  # rank 0's error


def test_two_ddp_groups_stream_as_two_single_process_workers(tmp_path: Path) -> None:
    """Two DDP groups (P=2, tau 1) through one server weighting by samples: each fragment's
    round averages the two groups weighted by the samples of both ranks of each (unequal across
    ranks, so weighing rank 0's alone fails), as two single-process streaming workers reporting
    those sums; one registration per group."""
    config = ServerConfig(port=0, num_workers=2, weighting="samples")
    with DiLoCoServer(config) as server:
        groups = [
            ranks.spawn(sr.ddp_rank, (server.address, str(tmp_path), 2, 1, False, g))
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    with DiLoCoServer(config) as ref_server:
        models = [ranks.make_model() for _ in range(2)]  # here: make_model seeds the process
        expected_steps = in_threads(
            2, lambda g: sr.reference_ddp(ref_server.address, 2, 1, g, models[g]), timeout=120
        )
        expected = ref_server.global_params()
    assert status["registrations"] == 2
    for g in range(2):
        r0, r1 = (torch.load(tmp_path / f"g{g}s{r}.pt") for r in range(2))
        _assert_ranks_identical(r0, r1)
        _assert_as_reference(r0[1:], expected_steps[g])
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
