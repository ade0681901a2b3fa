"""Regional relays (``diloco server --upstream``): regions of workers through relays under one
upstream server equal a reference written out directly (each region averages its workers, the
upstream averages the regions, one outer step), and the upstream links carry one model per
region per round each way."""

from __future__ import annotations

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.cli.status import render_status
from diloco.server.observe.status import Status
from diloco.wire.messages import RegisterInfo
from diloco.worker.transport.client import Conflict
from tests.helpers.reference import (
    assert_same_params,
    make_inner,
    make_model,
    reference_rounds,
)
from tests.helpers.relays import regions, train_regions, upstream_of

SYNC_EVERY = 4
ROUNDS = 3


def reference_regions(sizes: tuple[int, ...], weighted: bool) -> dict[str, torch.Tensor]:
    """Hierarchical DiLoCo in one process: each region's mean pseudo-gradient, then the
    upstream's mean of the regions' means (``weighted``: by their worker counts) and its outer
    step."""
    weights = [float(n) if weighted else 1.0 for n in sizes]

    def regions_mean(pseudo_grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        first, means = 0, []
        for n in sizes:
            region = pseudo_grads[first : first + n]
            means.append([torch.stack(ts).sum(0) / n for ts in zip(*region, strict=True)])
            first += n
        return [
            sum(w * m[j] for w, m in zip(weights, means, strict=True)) / sum(weights)
            for j in range(len(means[0]))
        ]

    return reference_rounds(sum(sizes), SYNC_EVERY, ROUNDS, regions_mean)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sizes", "weighting"), [((2, 2), "equal"), ((1, 2), "equal"), ((1, 2), "samples")]
)
def test_regions_through_relays_match_the_hierarchical_reference(
    sizes: tuple[int, ...], weighting: str
) -> None:
    """Two relays and an upstream on 127.0.0.1: the upstream's parameters (and every relay's)
    equal the reference over three rounds. Uneven regions tell the weightings apart: the
    upstream's ``equal`` weighting averages the regions' means, ``samples`` weights each by
    its contribution count (what a relay sends as its upload's weight)."""
    expected = reference_regions(sizes, weighted=weighting == "samples")
    with regions(sizes, upstream={"weighting": weighting}, upstream_codec="fp32") as top:
        metrics = train_regions(top, sizes, make_model, SYNC_EVERY * ROUNDS, SYNC_EVERY)
        got = top.upstream.global_params()
        relayed = [relay.global_params() for relay in top.relays]
        up_status = top.upstream.status()
        relay_status = [relay.status() for relay in top.relays]
    assert all(m["rounds"] == ROUNDS for m in metrics)
    assert up_status["round"] == ROUNDS
    assert_same_params(got, expected)
    for params in relayed:  # each region publishes exactly the upstream's parameters
        assert all(torch.equal(params[n], got[n]) for n in got)
    for status in relay_status:
        link = status["upstream"]
        assert status["round"] == ROUNDS
        assert (link["round"], link["uploads"], link["last_error"]) == (ROUNDS, ROUNDS, None)
    # The upstream sees each relay as one worker, with its region's size as it last registered.
    assert sorted(w.get("region") for w in up_status["workers"]) == sorted(sizes)
    assert up_status["submissions"] == ROUNDS * len(sizes)
    # ``diloco status`` shows the hierarchy from either end.
    assert f"upstream round {ROUNDS}, {ROUNDS} uploads" in render_status(
        Status.from_json(relay_status[0])
    )
    assert render_status(Status.from_json(up_status)).count(" workers)") == len(sizes)


def test_the_reference_tells_the_weightings_apart() -> None:
    # Guards the test above against a vacuous pass: uneven regions make the two averages differ.
    a = reference_regions((1, 2), weighted=False)
    b = reference_regions((1, 2), weighted=True)
    assert any(not torch.allclose(a[n], b[n]) for n in a)


def wide_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(), torch.nn.Linear(256, 3))


#: HTTP request and reply heads, the safetensors header, the upload's JSON receipt: small
#: beside the model, and bounded.
OVERHEAD = 4096


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_each_upstream_link_carries_one_model_per_round_each_way(codec: str) -> None:
    """A counting proxy on each relay's upstream link, read as each upload starts: between two
    uploads (one round), one mean goes up (in the upstream codec) and one model of parameters
    comes down, whatever the region's size: not one per worker."""
    sizes, rounds, sync_every = (2, 2), 3, 2
    numel = sum(p.numel() for p in wide_model().parameters())
    marks: list[list[dict[str, int]]] = [[] for _ in sizes]
    with regions(sizes, upstream_codec=codec) as top:
        for k, relay in enumerate(top.relays):

            def mark(moment: str, sid: str, k: int = k) -> None:
                if moment == "upload":
                    marks[k].append(dict(top.links[k].moved))

            upstream_of(relay).at = mark
        train_regions(top, sizes, wide_model, rounds * sync_every, sync_every)
        ends = [dict(link.moved) for link in top.links]
        statuses = [relay.status() for relay in top.relays]
    up_model = numel * (4 if codec == "fp32" else 2)
    for k in range(len(sizes)):
        assert len(marks[k]) == rounds
        points = [*marks[k], ends[k]]
        for before, after in zip(points, points[1:], strict=False):
            up = after["up"] - before["up"]
            down = after["down"] - before["down"]
            assert up_model <= up < up_model + OVERHEAD, (k, up)
            assert numel * 4 <= down < numel * 4 + OVERHEAD, (k, down)
        link = statuses[k]["upstream"]
        assert up_model <= link["last_upload_bytes"] < up_model + OVERHEAD
        assert numel * 4 <= link["last_download_bytes"] < numel * 4 + OVERHEAD


@pytest.mark.timeout(60)
def test_a_fresh_relay_takes_the_upstreams_parameters_with_its_token() -> None:
    """The upstream has parameters (and a token): a relay given ``upstream_token`` registers,
    takes them, and its first worker, whose own model differs, trains from them; a worker asking
    for streaming fragments is refused."""
    torch.manual_seed(3)
    start = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    start = {n: t + 1.0 for n, t in start.items()}  # not what make_model() gives a worker
    token = "upstream-secret"
    with (
        DiLoCoServer(ServerConfig(port=0, token=token), initial_params=start) as up,
        DiLoCoServer(
            ServerConfig(port=0, upstream=up.address, upstream_token=token, upstream_codec="fp32")
        ) as relay,
    ):
        model = make_model()
        with DiLoCoWorker(
            model, make_inner(model), relay.address, sync_every=100, heartbeat_interval=0
        ):
            held = {n: p.detach().clone() for n, p in model.named_parameters()}
        status = relay.status()
        # A relay's rounds are whole-model: a worker that streams fragments is refused.
        asker = DiLoCoClient(relay.address, retries=0)
        with pytest.raises(Conflict) as refused:
            asker.register(info=RegisterInfo(num_fragments=4))
        asker.close()
        assert refused.value.code == "fragments_mismatch"
    for name, value in start.items():
        assert torch.equal(held[name], value)
    assert status["upstream"]["round"] == 0 and status["upstream"]["last_error"] is None
