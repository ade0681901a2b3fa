"""The inner optimizers a quality trial can choose (benchmarks/harness/inner.py): which parameters
Muon gets, and that Muon with AdamW is one optimizer a DiLoCoWorker can hook."""

from __future__ import annotations

import pytest
import torch
from benchmarks.harness.inner import MuonAdamW, make_inner, muon_groups

from diloco.demo.model import build_model, loss_on


def test_muon_gets_the_hidden_matrices_and_adamw_the_rest() -> None:
    """In the demo model Muon gets exactly the four weight matrices of each block (attention in
    and out, the two feed-forward layers); the token embedding, learned positions and output head
    (matrices too), the norms and the biases go to AdamW; nothing is left out or given twice."""
    model = build_model(0)
    muon, adamw = muon_groups(model.named_parameters())
    per_block = ["self_attn.in_proj_weight", "self_attn.out_proj.weight"]
    per_block += ["linear1.weight", "linear2.weight"]
    assert muon == [f"blocks.layers.{i}.{n}" for i in range(2) for n in per_block]
    assert {"embed.weight", "pos", "head.weight", "norm.weight", "norm.bias"} <= set(adamw)
    assert sorted(muon + adamw) == sorted(n for n, _ in model.named_parameters())
    shapes = dict(model.named_parameters())
    assert all(shapes[n].ndim == 2 for n in muon)
    assert all(
        shapes[n].ndim == 1 for n in adamw if n not in ("embed.weight", "pos", "head.weight")
    )


def test_a_matrix_outside_the_hidden_layers_goes_to_adamw_by_its_prefix() -> None:
    """The prefixes name the non-hidden matrices: changing them moves a matrix between groups."""
    named = [
        ("embed.weight", torch.nn.Parameter(torch.zeros(4, 3))),
        ("mlp.weight", torch.nn.Parameter(torch.zeros(3, 3))),
    ]
    assert muon_groups(named) == (["mlp.weight"], ["embed.weight"])
    assert muon_groups(named, not_hidden=("mlp",)) == (["embed.weight"], ["mlp.weight"])


def test_muon_with_adamw_steps_both_under_one_hook_and_one_lr() -> None:
    """One ``step`` moves every parameter (both inner optimizers ran) and fires a post-step hook
    once, after both (what DiLoCoWorker counts inner steps by); an lr set on ``param_groups`` (the
    trial's schedule) reaches both optimizers."""
    torch.manual_seed(0)
    model = build_model(0)
    opt = make_inner("muon", model, 1e-3)
    assert isinstance(opt, MuonAdamW)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen: list[bool] = []

    def hook(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        seen.append(all(not torch.equal(before[n], p) for n, p in model.named_parameters()))

    opt.register_step_post_hook(hook)
    x = torch.randint(0, 256, (2, 17))
    loss_on(model, x[:, :-1], x[:, 1:]).backward()
    opt.step()
    assert seen == [True]
    for group in opt.param_groups:
        group["lr"] = 0.5
    assert opt.muon.param_groups[0]["lr"] == 0.5 and opt.adamw.param_groups[0]["lr"] == 0.5


def test_adamw_is_the_default_and_unknown_kinds_are_refused() -> None:
    model = build_model(0)
    assert type(make_inner("adamw", model, 1e-3)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="unknown inner optimizer 'sgd'"):
        make_inner("sgd", model, 1e-3)
    with pytest.raises(ValueError, match="at least one hidden"):
        MuonAdamW([], list(model.parameters()), 1e-3)
