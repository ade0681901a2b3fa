"""No accepted input makes the global parameters non-finite (issue 15, finding 4): weights out of
bounds are refused, a round or update whose result would not be finite is refused with the
parameters and outer optimizer state kept, and robust aggregation averages what it should."""

from __future__ import annotations

import math
from typing import Any

import pytest
import requests
import safetensors.torch
import torch

from diloco.core.outer import OuterSGD
from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    assert_error,
    assert_params_equal,
    body,
    expected_exact,
    pseudo_grad,
    register,
    submit,
    url,
    wait_round,
)
from tests.helpers.servers import ServerFactory, initial_params


def served(server: DiLoCoServer) -> dict[str, torch.Tensor]:
    """The parameters a worker downloads."""
    resp = requests.get(url(server, "/global_params"), timeout=TIMEOUT)
    assert resp.status_code == 200
    return safetensors.torch.load(resp.content)


def http_status(server: DiLoCoServer) -> dict[str, Any]:
    return requests.get(url(server, "/status"), timeout=TIMEOUT).json()


def metric(server: DiLoCoServer, line_start: str) -> float:
    text = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{line_start} not in /metrics:\n{text}")


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def filled(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.full((4,), value)}


def good_round(server: DiLoCoServer, round_: int, old: dict[str, torch.Tensor]) -> None:
    """Workers a and b contribute to ``round_``; it must close with exactly their mean."""
    accept(server, body("a", round_, f"a-{round_}", seed=10 + round_))
    accept(server, body("b", round_, f"b-{round_}", seed=20 + round_))
    wait_round(server, round_ + 1)
    want = expected_exact(old, pseudo_grad(10 + round_), pseudo_grad(20 + round_))
    assert_params_equal(served(server), want)


@pytest.mark.parametrize("weight", ["1e39", "1e-320", "1e13", "1e-7"])
def test_weight_out_of_bounds_is_refused(make_server: ServerFactory, weight: str) -> None:
    # 1e39 is a finite Python float but inf in fp32; two 1e-320 make a total weight of ~0.
    server = make_server(num_workers=2, weighting="samples", **EXACT)
    register(server, "a")
    register(server, "b")
    old = served(server)
    for worker in ("a", "b"):
        reply = assert_error(
            submit(server, body(worker, 0, f"{worker}-bad", seed=1, weight=weight)),
            400,
            "bad_metadata",
        )
        assert "weight" in reply["detail"] and "1e+12" in reply["detail"]
    st = http_status(server)
    assert st["round"] == 0 and st["submitted"] == []
    assert metric(server, 'diloco_http_responses_total{code="400"}') == 2
    assert_params_equal(served(server), old)
    good_round(server, 0, old)


def test_weights_at_the_bounds_are_accepted(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, weighting="samples", **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", seed=1, weight="1e-6"))
    accept(server, body("b", 0, "b-0", seed=2, weight="1e12"))
    wait_round(server, 1)
    assert finite(served(server)) and http_status(server)["refused_updates"] == 0


def test_a_round_whose_sum_overflows_is_refused(make_server: ServerFactory) -> None:
    # Each upload is finite; their fp32 sum (equal weighting) is inf.
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    old = served(server)
    accept(server, body("a", 0, "a-0", filled(3e38)))
    accept(server, body("b", 0, "b-0", filled(3e38)))
    # The round ends (nobody waits forever) with the parameters as they were.
    wait_round(server, 1)
    got = served(server)
    assert finite(got)
    assert_params_equal(got, old)
    st = http_status(server)
    assert st["refused_updates"] == 1
    assert st["last_refusal"]["round"] == 0 and "not finite" in st["last_refusal"]["reason"]
    assert st["update_log"][-1]["refused"] is True
    assert metric(server, "diloco_refused_updates_total") == 1
    good_round(server, 1, old)
    assert http_status(server)["refused_updates"] == 1


def test_a_step_that_overflows_keeps_parameters_and_momentum(make_server: ServerFactory) -> None:
    # Finite parameters and a finite mean pseudo-gradient, but p - lr * (g + m * b) overflows.
    params = initial_params()
    params["b"][0] = 3e38
    server = make_server(params=params, num_workers=1, outer_lr=0.7, outer_momentum=0.9)
    register(server, "a")
    first = pseudo_grad(1)
    accept(server, body("a", 0, "a-0", first))
    wait_round(server, 1)
    after_first = served(server)
    optimizer = server.front.optimizer
    assert optimizer is not None
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in server.front.units[0].params]
    bad = pseudo_grad(2)
    bad["b"][0] = -3e38
    accept(server, body("a", 1, "a-1", bad))
    wait_round(server, 2)
    assert_params_equal(served(server), after_first)
    for p, saved in zip(server.front.units[0].params, momentum, strict=True):
        assert torch.equal(optimizer.state[p]["momentum_buffer"], saved)
    assert http_status(server)["refused_updates"] == 1
    assert metric(server, "diloco_refused_updates_total") == 1
    # The next round steps as if the refused one had never been: a reference optimizer that saw
    # only the good rounds.
    third = pseudo_grad(3)
    accept(server, body("a", 2, "a-2", third))
    wait_round(server, 3)
    ref = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in params.items()}
    ref_opt = OuterSGD(list(ref.values()), lr=0.7, momentum=0.9)
    for g in (first, third):
        for name, p in ref.items():
            p.grad = g[name]
        ref_opt.step()
    got = served(server)
    for name, p in ref.items():
        torch.testing.assert_close(got[name], p.data, rtol=0, atol=0)


def test_an_async_update_that_overflows_is_refused(make_server: ServerFactory) -> None:
    server = make_server(num_workers=1, mode="async", **EXACT)
    register(server, "a")
    old = served(server)
    reply = accept(server, body("a", 0, "a-0", filled(-3e38)))
    reply2 = accept(server, body("a", 1, "a-1", filled(-3e38)))  # on top: 3e38 + 3e38
    assert "refused" not in reply and reply2["refused"] and reply2["version"] == 2
    first = served(server)
    assert finite(first)
    assert_params_equal(first, {n: old[n] + 3e38 for n in old})
    assert http_status(server)["refused_updates"] == 1
    assert metric(server, "diloco_refused_updates_total") == 1
    accept(server, body("a", 2, "a-2", filled(1.0)))
    assert_params_equal(served(server), {n: first[n] - 1.0 for n in old})


# --- robust aggregation --------------------------------------------------------------------------


def test_trimmed_mean_round(make_server: ServerFactory) -> None:
    server = make_server(num_workers=5, trim_fraction=0.2, **EXACT)
    workers = ["a", "b", "c", "d", "e"]
    for w in workers:
        register(server, w)
    old = served(server)
    values = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 1e30}  # e: an attacker
    for w in workers:
        accept(server, body(w, 0, f"{w}-0", filled(values[w])))
    wait_round(server, 1)
    # k = 1 at each end: mean(2, 3, 4) = 3 in every coordinate.
    assert_params_equal(served(server), {n: old[n] - 3.0 for n in old})
    st = http_status(server)
    assert st["robust_aggregation"] == {"clip_norm_factor": None, "trim_fraction": 0.2}


def test_norm_clipping_round(make_server: ServerFactory) -> None:
    server = make_server(num_workers=3, clip_norm_factor=2.0, **EXACT)
    for w in ("a", "b", "c"):
        register(server, w)
    old = served(server)
    accept(server, body("a", 0, "a-0", filled(1.0)))
    accept(server, body("b", 0, "b-0", filled(1.0)))
    accept(server, body("c", 0, "c-0", filled(-1000.0)))
    wait_round(server, 1)
    # Norms 4, 4, 4000 (16 elements); median 4, limit 8: c is scaled to -2 per element.
    # mean(1, 1, -2) = 0: the attacker moved nothing.
    got = served(server)
    for name in old:
        torch.testing.assert_close(got[name], old[name], rtol=0, atol=1e-6)
    assert not math.isnan(float(got["w"][0, 0]))


@pytest.mark.parametrize(
    "config",
    [
        {"trim_fraction": 0.5},
        {"trim_fraction": -0.1},
        {"clip_norm_factor": 0.0},
        {"clip_norm_factor": math.inf},
        {"mode": "async", "clip_norm_factor": 2.0},
        {"mode": "async", "trim_fraction": 0.1},
    ],
)
def test_robust_aggregation_settings_are_validated(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**config)


def test_robust_aggregation_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.cli.main import main
    from tests.helpers.cli import captured_config

    seen = captured_config(monkeypatch)
    assert main(["server", "--port", "0"]) == 0
    assert main(["server", "--port", "0", "--clip-norm-factor", "3", "--trim-fraction", "0.1"]) == 0
    assert (seen[0].clip_norm_factor, seen[0].trim_fraction) == (None, 0.0)
    assert (seen[1].clip_norm_factor, seen[1].trim_fraction) == (3.0, 0.1)
    assert main(["server", "--port", "0", "--trim-fraction", "0.5"]) != 0
