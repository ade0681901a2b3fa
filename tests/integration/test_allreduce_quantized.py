"""All-reduce mode with int8, int4 and topk collectives end to end (issue 30 item 4): real
workers in threads naming ``codec="int8"``, ``"int4"`` or ``"topk"``, a real server with
``allreduce=True``. Every replica holds the same bits after every round, the run stays close to
the fp32 all-reduce run (topk, keeping 2 of this model's 131 parameters a round, only finite and
bounded), and ``sync_metrics`` counts the bytes each member moved."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.worker.allreduce.collective import QuorumCollective, QuorumFailed
from tests.helpers.allreduce import PERIODS, run_streaming, run_workers

ROUNDS = 3


def run(n: int, codec: str | None) -> tuple[list[Any], dict[int, list[list[torch.Tensor]]]]:
    """The run's results and every worker's state (snapshot, momentum) after each round."""
    seen: dict[int, list[list[torch.Tensor]]] = {}
    lock = threading.Lock()

    def record(rank: int, r: int, w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        state = [t.clone() for t in [*w._local.snapshot.values(), *strategy._state.momentum]]
        with lock:
            seen.setdefault(w.base_round, []).append(state)

    kw: dict[str, Any] = {} if codec is None else {"codec": codec}
    with DiLoCoServer(ServerConfig(port=0, num_workers=n, allreduce=True)) as srv:
        results = run_workers(srv.address, n, ROUNDS, after_sync=record, **kw)
    return results, seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("codec", ["int8", "int4", "topk"])
def test_quantized_quorums_keep_replicas_identical_after_every_round(n: int, codec: str) -> None:
    results, seen = run(n, codec)
    fp32, _ = run(n, None)
    assert sorted(seen) == list(range(1, ROUNDS + 1))
    for r, states in seen.items():
        assert len(states) == n
        for other in states[1:]:
            for a, b in zip(other, states[0], strict=True):
                assert torch.equal(a, b), (r, codec)
    if codec == "topk":  # most of each round is owed, not sent: finite, and the state moves
        assert all(bool(torch.isfinite(t).all()) for t in seen[ROUNDS][0])
        assert not all(torch.equal(a, b) for a, b in zip(seen[1][0], seen[ROUNDS][0], strict=True))
    else:
        tolerance = {"int8": 0.02, "int4": 0.1}[codec]
        for k in fp32[0][0]:
            got, want = results[0][0][k], fp32[0][0][k]
            assert not torch.equal(got, want)
            assert float((got - want).norm()) <= tolerance * float(want.norm()), (k, codec)
    for _, m in results:
        assert m["rounds"] == ROUNDS and m["failed_syncs"] == 0
        # Slots of scales and codes: about 1.03 (int8) or 0.53 (int4) bytes per parameter,
        # moved (N - 1) slots each way in the all-to-all and again in the all-gather.
        assert 0 < m["collective_sent"] == m["collective_received"]
        assert m["collective_bytes"] < (ROUNDS * 187 * (1.1 if codec == "int8" else 0.6)) + 64 * 8
    # fp32: the payload is 4 bytes per parameter; a ring moves 2 (N-1) / N of it each way.
    for _, m in fp32:
        payload = ROUNDS * 4 * 131
        assert m["collective_bytes"] == payload
        assert (
            m["collective_sent"]
            == m["collective_received"]
            == ROUNDS * (2 * (n - 1) * 4 * 131 // n)
        )


@pytest.mark.timeout(240)
def test_streaming_fragments_keep_one_residual_per_fragment_and_identical_replicas() -> None:
    """int8 with two strided fragments overlapped with training: every worker holds the same
    state after every round, and each worker keeps one residual per fragment, keyed by the
    round's fragment (``round mod P``) before the buffer's table (tables of equal fragments
    would coincide)."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        results = run_streaming(
            srv.address,
            2,
            codec="int8",
            num_fragments=2,
            fragment_pattern="strided",
            overlap_steps=1,
            merge_alpha=0.5,
        )
    common = set.intersection(*(set(r["states"]) for r in results))
    assert len(common) >= PERIODS * 2 - 1
    for r in common:
        for a, b in zip(results[0]["states"][r], results[1]["states"][r], strict=True):
            assert torch.equal(a, b), r
    for r in results:
        m = r["metrics"]
        assert m["failed_syncs"] == 0 and m["discarded_rounds"] == 0
        assert 0 < m["collective_sent"] == m["collective_received"]
        keys = sorted(r["residual_keys"])
        assert [k.split(";")[0] for k in keys] == ["0", "1"]


@pytest.mark.timeout(240)
def test_a_mixed_quorum_averages_with_the_widest_codec_on_every_member() -> None:
    """w0 registers int4, w1 int8: the quorum's comm is int8 and both members run the int8
    collective (the int4 member too), so both send int8 slots and end bit-identical."""
    seen: dict[int, list[list[torch.Tensor]]] = {}
    lock = threading.Lock()

    def record(rank: int, r: int, w: DiLoCoWorker) -> None:
        with lock:
            seen.setdefault(w.base_round, []).append(
                [t.clone() for t in w._local.snapshot.values()]
            )

    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        mixed = run_workers(
            srv.address, 2, ROUNDS, after_sync=record,
            per_rank=lambda rank: {"codec": ("int4", "int8")[rank]},
        )  # fmt: skip
    int8, _ = run(2, "int8")
    for states in seen.values():
        for a, b in zip(states[0], states[1], strict=True):
            assert torch.equal(a, b)
    for (_, m), (_, ref) in zip(mixed, int8, strict=True):
        assert m["collective_sent"] == ref["collective_sent"] > 0  # int8 slots, not int4's


@pytest.mark.timeout(240)
def test_a_round_discarded_inside_the_quantized_collective_changes_no_residual(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's group breaks at round 2's all-gather (after the all-to-all moved every slot and
    each member computed its new residual): the round is discarded on both, and the repeat
    sends the same contributions with the same residuals, so the run ends bit for bit where the
    fault-free run ends. A residual adopted before the commit point would change the bits."""
    clean, _ = run(2, "int8")
    original = QuorumCollective.collective
    calls: list[int] = []

    def collective(self: QuorumCollective, what: str, start: Any) -> None:
        if what == "quantized all-gather" and self.rank == 1:
            calls.append(1)
            if len(calls) == 2:
                self.close()
                raise QuorumFailed(self.quorum_id, "all-gather failed: injected")
        original(self, what, start)

    monkeypatch.setattr(QuorumCollective, "collective", collective)
    faulty, _ = run(2, "int8")
    assert sum(m["discarded_rounds"] for _, m in faulty) == 2  # on both members
    for (params, m), (ref, _) in zip(faulty, clean, strict=True):
        assert m["rounds"] == ROUNDS
        for k in ref:
            assert torch.equal(params[k], ref[k]), k
