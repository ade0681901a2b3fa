"""The sparse downlink through a real server (issue 30 item 3): two ``topk`` workers under
``--outer-rule sparseloco`` with ``--download-codec sparse`` download each round as the positions
it changed with their new values, and after every such download hold exactly the bytes a full
download serves; a parameter where the two uploads cancel stays unchanged; a joiner gets full
parameters; the bytes per round are at least 20x below the dense download's at SparseLoCo's
density. Also: a malformed update is answered by a full download that changes nothing first, a
round whose update would not be smaller goes as full parameters, only a replica exactly one
round behind is served the update (a re-joiner and one two rounds behind get full parameters),
and the refusals at start.
The maths alone: tests/unit/test_sparse_update.py."""

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import pytest
import requests
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.core.codecs.sparse_update import pack_positions, unpack_positions
from diloco.server.params.sparse_bodies import SparseDownlink
from diloco.wire import parse_header, tensor_views
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.servers import published
from tests.helpers.threads import in_threads

TOPK = "topk:density=0.0156,chunk=4096,bits=2"
ROUNDS = 4
EVERY = 2
LR = 0.125  # inner SGD: a power of two, so the cancelling parameter's steps are exact


class Net(torch.nn.Module):
    """About 1M parameters (so the ratio of bytes means something) and ``cancel``, whose
    pseudo-gradients the two workers make exact opposites (their uploads then cancel)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(1024, 1024)
        self.cancel = torch.nn.Parameter(torch.zeros(4096))


def assert_bitwise(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), params[name].view(torch.int32)), name


def sparse_config(**kw: Any) -> ServerConfig:
    settings: dict[str, Any] = {"num_workers": 2, **kw}
    return ServerConfig(port=0, outer_rule="sparseloco", download_codec="sparse", **settings)


def test_two_topk_workers_stay_bit_identical_with_sparse_downloads_20x_below_dense() -> None:
    reached, resume = threading.Barrier(3, timeout=60), threading.Event()
    residuals: list[torch.Tensor] = []
    dense = 4 * sum(p.numel() for p in Net().parameters())  # a full download's payload alone
    with DiLoCoServer(sparse_config(outer_lr=0.5)) as srv:
        address = srv.address

        def run(rank: int) -> tuple[Net, dict[str, float], list[int], list[int]]:
            model = Net()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            gen = torch.Generator().manual_seed(10 + rank)
            # ``cancel``'s gradient: the same on both workers up to the sign, every step, of
            # distinct magnitudes (no zero or tied value, where the codes' rounding to even
            # would not mirror) that are multiples of 2**-10 (so lr * g is exact).
            cgen = torch.Generator().manual_seed(99)
            g = (torch.randperm(4096, generator=cgen) + 1025).float() / 1024
            g[torch.rand(4096, generator=cgen) < 0.5] *= -1
            rounds, down = [], []
            with DiLoCoWorker(
                model, opt, address, sync_every=EVERY, heartbeat_interval=0, codec=TOPK
            ) as w:
                for _ in range(ROUNDS * EVERY):
                    model.fc.weight.grad = torch.randn(model.fc.weight.shape, generator=gen)
                    model.fc.bias.grad = torch.randn(model.fc.bias.shape, generator=gen)
                    model.cancel.grad = g if rank == 0 else -g
                    opt.step()
                    w.report(samples=1)
                    if w.local_step == 0:  # this step's hook synced
                        r, params = published(address)
                        assert r == w.base_round
                        assert_bitwise(model, params)
                        rounds.append(r)
                        down.append(int(w.sync_metrics["last_bytes_down"]))
                        if r == 2:
                            reached.wait()  # the joiner comes now
                            assert resume.wait(60)
                fb = w._encoder.feedback
                assert fb is not None
                residuals.append(fb.residuals["cancel"].clone())
                return model, dict(w.sync_metrics), rounds, down

        def joiner() -> None:
            reached.wait()
            try:
                model = Net()
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                with DiLoCoWorker(model, opt, address, heartbeat_interval=0, codec=TOPK) as w:
                    assert w.base_round == 2
                    m = w.sync_metrics
                    assert (m["full_downloads"], m["update_downloads"]) == (1, 0)
                    assert_bitwise(model, published(address)[1])
            finally:
                resume.set()

        results = in_threads(3, lambda i: run(i) if i < 2 else joiner(), timeout=100)
        final = srv.global_params()
        status = srv.status()
    for model, metrics, rounds, down in results[:2]:
        assert rounds == list(range(1, ROUNDS + 1))
        assert_bitwise(model, final)
        assert metrics["full_downloads"] == 1  # the join's
        assert metrics["update_downloads"] == ROUNDS
        assert metrics["checksum_mismatches"] == 0 and metrics["failed_syncs"] == 0
        ratios = [dense / d for d in down]
        print(
            f"sparse downlink: bytes per round {down}, dense {dense}, ratio "
            f"{', '.join(f'{x:.1f}' for x in ratios)}x"
        )
        assert min(ratios) >= 20
    assert status["update_downloads"] == 2 * ROUNDS
    # The uploads cancel on ``cancel``: it never moved, though both workers trained it.
    assert torch.equal(final["cancel"].view(torch.int32), torch.zeros(4096, dtype=torch.int32))
    a, b = residuals  # both sent values there: what they kept back mirrors, and is not zero
    assert torch.equal(a, -b) and a.abs().sum() > 0
    assert not torch.equal(final["fc.weight"], Net().fc.weight.detach())


def one_worker_rounds(
    address: str, rounds: int, codec: str = TOPK, after: Any = None
) -> tuple[torch.nn.Module, dict[str, float]]:
    """One worker syncing after every step for ``rounds`` rounds, compared bit for bit with a
    full download after each."""
    model = torch.nn.Linear(256, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    with DiLoCoWorker(model, opt, address, sync_every=1, heartbeat_interval=0, codec=codec) as w:
        for r in range(1, rounds + 1):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            w.report(samples=1)
            assert w.base_round == r
            assert_bitwise(model, published(address)[1])
        return model, dict(w.sync_metrics)


def test_a_malformed_update_is_refused_and_answered_by_a_full_download(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encode = SparseDownlink.encode

    def corrupt(self: SparseDownlink, new_round: int, names: Any, sums: Any) -> None:
        """Round 2's update repeats an index: what a broken server might send."""
        encode(self, new_round, names, sums)
        body = self.current
        if new_round == 2 and body is not None:
            views = tensor_views(parse_header(body.header[8:]), body.buffer.payload)
            idx = views["weight@idx"]
            pos = unpack_positions(idx, views["weight"].numel())
            pos[1] = pos[0]
            idx.copy_(pack_positions(pos))

    monkeypatch.setattr(SparseDownlink, "encode", corrupt)
    with DiLoCoServer(sparse_config(num_workers=1)) as srv:
        _, m = one_worker_rounds(srv.address, 3)
    assert (m["update_downloads"], m["full_downloads"]) == (2, 2)  # round 2 came in full
    assert m["checksum_mismatches"] == 0 and m["failed_syncs"] == 0


def test_a_round_whose_update_is_not_smaller_goes_as_full_parameters() -> None:
    # int8 uploads are dense: the round changes every position, and 5.5 bytes per change would
    # be more than the 4 of full parameters.
    with DiLoCoServer(sparse_config(num_workers=1)) as srv:
        _, m = one_worker_rounds(srv.address, 2, codec="int8")
        assert srv.front.model.sparse is not None
        assert srv.front.model.sparse.current is None
    assert (m["update_downloads"], m["full_downloads"]) == (0, 3)
    assert m["checksum_mismatches"] == 0


def test_configurations_the_sparse_downlink_cannot_serve_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--download-codec sparse.*plain averaged descent"):
        ServerConfig(download_codec="sparse")  # sgd: momentum 0.9 moves every parameter
    with pytest.raises(ValueError, match=r"--download-codec.*needs sync mode.*async"):
        ServerConfig(download_codec="sparse", outer_rule="sparseloco", mode="async")
    with pytest.raises(ValueError, match=r"--download-codec.*fragments"):
        ServerConfig(download_codec="sparse", outer_rule="sparseloco", num_fragments=2)
    assert ServerConfig(download_codec="sparse", outer_momentum=0.0).sparse_download
    assert not ServerConfig(download_codec="sparse", outer_rule="sparseloco").keeps_true_copy


def metadata(address: str, query: str) -> dict[str, str]:
    resp = requests.get(f"http://{address}/global_params?{query}", timeout=10)
    assert resp.status_code == 200, resp.text
    (n,) = struct.unpack("<Q", resp.content[:8])
    meta: dict[str, str] = json.loads(resp.content[8 : 8 + n])["__metadata__"]
    return meta


def test_only_a_replica_one_round_behind_gets_the_update_and_a_rejoiner_gets_full() -> None:
    with DiLoCoServer(sparse_config(num_workers=1)) as srv:
        model = torch.nn.Linear(256, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(4)
        address = srv.address
        with DiLoCoWorker(model, opt, address, sync_every=1, heartbeat_interval=0, codec=TOPK) as w:
            for step in range(4):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()  # step 2: the upload is refused as unknown, the worker re-joins
                w.report(samples=1)
                if step != 2:  # (the re-join keeps its progress for the next upload)
                    assert_bitwise(model, published(address)[1])
                if step == 1:  # the server forgets the worker, as after an eviction
                    client = DiLoCoClient(address, retries=1, backoff=0.01)
                    assert w.worker_id is not None
                    client.deregister(w.worker_id)
                    client.close()
            m = dict(w.sync_metrics)
        assert m["reconnections"] == 1 and m["checksum_mismatches"] == 0
        assert m["full_downloads"] == 2  # the join's and the re-join's
        assert m["update_downloads"] >= 2
        now = srv.status()["round"]
        update = metadata(srv.address, f"min_round={now}&have_round={now - 1}")
        assert (update["kind"], update["codec"], update["base_round"]) == (
            "update",
            "sparse",
            str(now - 1),
        )
        for query in (f"min_round={now}&have_round={now - 2}", f"min_round={now}"):
            full = metadata(srv.address, query)  # two rounds behind, or a joiner
            assert full["kind"] == "global_params" and full["download_codec"] == "sparse"
            assert full["checksum"] == update["checksum"]
