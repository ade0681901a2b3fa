"""Quorum groups between real processes (tests/programs/quorum_member.py): weighted averages that are
bit-identical on every rank, a broadcast, and peers that die or freeze mid all-reduce."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from diloco.worker.allreduce import connect as quorum_connect
from diloco.worker.allreduce.collective import QuorumCollective, QuorumFailed, average, state_hash
from tests.helpers.quorum import member_tensors, mixed_tensors
from tests.helpers.rendezvous_host import RendezvousHost
from tests.helpers.threads import in_threads

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0  # the groups' timeout, seconds
MARGIN = 3.0  # scheduling slack on a loaded machine
SHAPES = [[3, 5], [1000], [70_001], [0]]
BIG = [[1_000_000]] * 4  # 16 MB: four 4 MB buckets


class Member:
    """A quorum_member process; ``ask`` sends a command, ``reply`` reads the next line."""

    def __init__(self, log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.programs.quorum_member"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
        )
        self._lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))

    def ask(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            answer = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no reply; log: {self.log_path.read_text()[-2000:]}") from None
        # Every answer reports it: the default process group is never initialised.
        assert answer.get("initialized") in (None, False), answer
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="module")
def rendezvous():
    with RendezvousHost(TIMEOUT) as host:
        yield host


@pytest.fixture(scope="module")
def spawn(tmp_path_factory):
    """spawn(n): n members started together (importing torch is most of their start-up)."""
    started: list[Member] = []
    logs = tmp_path_factory.mktemp("members")

    def start(n: int) -> list[Member]:
        members = [Member(logs / f"member{len(started) + i}.log") for i in range(n)]
        started.extend(members)
        for m in members:
            assert m.reply() == {"ready": True}
        return members

    yield start
    for m in started:
        m.stop()


@pytest.fixture(scope="module")
def trio(spawn):
    return spawn(3)


def form(members: list[Member], rendezvous: RendezvousHost, quorum: str) -> None:
    for rank, m in enumerate(members):
        m.ask(
            op="build",
            server=rendezvous.address,
            quorum=quorum,
            rank=rank,
            size=len(members),
            timeout=TIMEOUT,
        )
    for m in members:
        assert m.reply()["ok"]


def weighted_mean(seed: int, weights: list[float], shapes: list[list[int]]) -> list[torch.Tensor]:
    per_rank = [member_tensors(seed, r, shapes) for r in range(len(weights))]
    total = sum(weights)
    return [
        sum(w * ts[i] for w, ts in zip(weights, per_rank, strict=True)) / total
        for i in range(len(shapes))
    ]


def results(path: Path, n: int) -> list[torch.Tensor]:
    loaded = load_file(path)
    return [loaded[f"t{i}"] for i in range(n)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_ranks_average_to_the_weighted_mean_bit_identically(
    trio, rendezvous, tmp_path, dtype
):
    form(trio, rendezvous, f"avg-{dtype}")
    weights = [1.0, 2.0, 3.5]
    for rank, m in enumerate(trio):
        m.ask(
            op="average",
            seed=7,
            shapes=SHAPES,
            weight=weights[rank],
            dtype=dtype,
            bucket_bytes=64 << 10,
            out=str(tmp_path / f"r{rank}.safetensors"),
        )
    replies = [m.reply() for m in trio]
    assert all(r["ok"] and r["weight_sum"] == sum(weights) for r in replies), replies
    # Gloo hands every rank the same bytes: the replicas' hashes agree, and so do the bytes.
    assert len({r["hash"] for r in replies}) == 1
    got = [results(tmp_path / f"r{rank}.safetensors", len(SHAPES)) for rank in range(3)]
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other, strict=True))
    expected = weighted_mean(7, weights, SHAPES)
    # bf16 carries about 3 significant digits, rounded on each of the ring's additions.
    tolerance = {} if dtype == "float32" else {"rtol": 2e-2, "atol": 3e-2}
    for a, e in zip(got[0], expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, e, **tolerance)


@pytest.mark.timeout(60)
def test_broadcast_from_rank_1_reaches_every_rank_bit_for_bit(trio, rendezvous, tmp_path):
    form(trio, rendezvous, "bcast")
    for rank, m in enumerate(trio):
        m.ask(
            op="broadcast",
            seed=3,
            src=1,
            bucket_bytes=40_000,
            out=str(tmp_path / f"r{rank}.safetensors"),
        )
    replies = [m.reply() for m in trio]
    source = mixed_tensors(3, 1)
    assert all(r["ok"] and r["hash"] == state_hash(source) for r in replies), replies
    for rank in range(3):
        got = results(tmp_path / f"r{rank}.safetensors", len(source))
        assert all(torch.equal(a, b) for a, b in zip(got, source, strict=True))


def start_fault(members: list[Member], rendezvous: RendezvousHost, quorum: str, tmp_path: Path):
    """The last member stops partway through a large average. It trips at its 4th collective
    (table check, weight sum, bucket 1, bucket 2): having completed bucket 1, every member is
    past the small collectives and inside the bucket sequence; it has issued bucket 2 and its
    bytes are on their way when it prints ``inside``. The fault lands right after that line."""
    form(members, rendezvous, quorum)
    victim = members[-1]
    for rank, m in enumerate(members):
        m.ask(
            op="average",
            seed=11,
            shapes=BIG,
            weight=1.0,
            dtype="float32",
            bucket_bytes=4 << 20,
            out=str(tmp_path / f"{quorum}-{rank}.safetensors"),
            trip_at=4 if m is victim else None,
        )
    assert victim.reply()["inside"]
    return victim


@pytest.mark.timeout(90)
def test_a_peer_killed_mid_allreduce_fails_the_quorum_and_survivors_regroup(
    spawn, rendezvous, tmp_path
):
    members = spawn(3)
    victim = start_fault(members, rendezvous, "kill-1", tmp_path)
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    survivors = members[:2]
    for m in survivors:
        failed = m.reply(timeout=TIMEOUT + MARGIN)
        assert failed["error"] == "QuorumFailed" and failed["closed"], failed
        # Its sockets are reset: no need to wait out the timeout (about 30 ms measured).
        assert failed["failed_at"] - killed_at < TIMEOUT, failed
    # The same processes repeat the round in a new quorum without the dead member.
    form(survivors, rendezvous, "kill-2")
    for rank, m in enumerate(survivors):
        m.ask(
            op="average",
            seed=5,
            shapes=SHAPES,
            weight=rank + 1.0,
            dtype="float32",
            bucket_bytes=1 << 20,
            out=str(tmp_path / f"again-{rank}.safetensors"),
        )
    replies = [m.reply() for m in survivors]
    assert all(r["ok"] for r in replies) and replies[0]["hash"] == replies[1]["hash"]
    got = results(tmp_path / "again-0.safetensors", len(SHAPES))
    for a, e in zip(got, weighted_mean(5, [1.0, 2.0], SHAPES), strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.timeout(90)
def test_a_frozen_peer_fails_the_quorum_within_the_timeout(spawn, rendezvous, tmp_path):
    members = spawn(3)
    victim = start_fault(members, rendezvous, "stop-1", tmp_path)
    os.kill(victim.proc.pid, signal.SIGSTOP)  # its sockets stay open: only the timeout helps
    stopped_at = time.monotonic()
    try:
        for m in members[:2]:
            failed = m.reply(timeout=TIMEOUT + MARGIN)
            assert failed["error"] == "QuorumFailed" and failed["closed"], failed
            assert failed["failed_at"] - stopped_at < TIMEOUT + MARGIN, failed
    finally:
        os.kill(victim.proc.pid, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_a_member_alone_gives_up_joining_within_the_timeout(rendezvous):
    began = time.monotonic()
    with pytest.raises(QuorumFailed, match="could not join"):
        QuorumCollective.build(rendezvous.meeting(0), "alone", 0, 2, 1.0)
    assert time.monotonic() - began < 1.0 + MARGIN
    assert not dist.is_initialized()


@pytest.mark.timeout(30)
def test_a_join_that_overruns_its_own_timeouts_is_given_up_at_the_hard_limit(
    rendezvous, monkeypatch
):
    """Gloo's connects are bounded one by one, not as a whole (a chaos run saw 50 s with a
    10 s timeout): a backend construction that hangs past twice the timeout plus the margin is
    given up on, and shut down by its thread once it ends."""
    release, shut = threading.Event(), threading.Event()

    class Hung:
        def abort(self) -> None:
            shut.set()

        def shutdown(self) -> None:
            pass

    def hanging_gloo(*args: Any) -> Hung:
        release.wait(30)
        return Hung()

    monkeypatch.setattr(quorum_connect, "_gloo", hanging_gloo)
    limit = 2 * 0.5 + quorum_connect.BUILD_MARGIN_S
    began = time.monotonic()
    with pytest.raises(QuorumFailed, match="longer than"):
        QuorumCollective.build(rendezvous.meeting(0), "hung", 0, 2, 0.5)
    assert limit <= time.monotonic() - began < limit + MARGIN
    assert not shut.is_set()
    release.set()  # the construction ends late: what it built is shut down, not leaked
    assert shut.wait(10)


@pytest.mark.timeout(30)
def test_bad_calls_are_refused_on_every_rank_and_the_quorum_forgotten(rendezvous):
    """In one process (two threads): a bad weight or a mismatched table raises ValueError on
    every rank, the group stays usable; the rendezvous then drops the quorum's keys."""
    meetings = [rendezvous.meeting(rank) for rank in range(2)]
    errors: dict[int, list[str]] = {0: [], 1: []}
    sums: dict[int, float] = {}
    refused: list[int] = []

    def member(rank: int) -> None:
        with QuorumCollective.build(meetings[rank], "threads", rank, 2, TIMEOUT) as group:
            for weight, tensors in [
                (-1.0 if rank else 1.0, [torch.ones(3)]),
                (1.0, [torch.ones(3 + rank)]),
            ]:
                try:
                    average(group, tensors, weight)
                except ValueError as err:
                    errors[rank].append(str(err))
            sums[rank] = average(group, [torch.ones(2)], 0.5)
        try:
            average(group, [torch.ones(2)], 0.5)
        except QuorumFailed as err:
            refused.append(rank) if "closed" in str(err) else None

    in_threads(2, member, timeout=20)
    assert [len(errors[r]) for r in range(2)] == [2, 2], errors
    assert "non-finite weight" in errors[0][0] and "tables" in errors[1][1]
    assert sums == {0: 1.0, 1: 1.0}
    assert sorted(refused) == [0, 1]  # a closed group is never used again
    assert rendezvous.call(lambda store: store.forget("threads")) == 2  # an address per member
    assert rendezvous.call(lambda store: store.forget("threads")) == 0


def test_state_hash_takes_strided_and_one_element_views() -> None:
    """The commit point hashes a strided sample of the average; a sample of one element keeps
    an odd stride under ``.contiguous()``, which must not stop the hash."""
    t = torch.arange(10, dtype=torch.float32)
    assert state_hash([t[::1009]]) == state_hash([t[:1].clone()])
    assert state_hash([t[::3]]) == state_hash([t[::3].clone()])
    assert state_hash([t[::3]]) != state_hash([t[::2].clone()])
