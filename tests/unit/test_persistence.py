"""Checkpoints: atomic, rotated, pickle-free, byte-identical across save/load/save."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco import DiLoCoServer, ServerConfig
from diloco.core import apply_outer_step, default_outer_optimizer
from diloco.server.persistence import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _optimizer_after_two_steps() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(3, 2), requires_grad=False),
        torch.nn.Parameter(torch.randn(4), requires_grad=False),
    ]
    opt = default_outer_optimizer(params)
    for _ in range(2):
        apply_outer_step(opt, params, [torch.randn_like(p) for p in params])
    return params, opt


def _digest(path: Path) -> dict[str, str]:
    return {
        f: hashlib.sha256((path / f).read_bytes()).hexdigest()
        for f in ("params.safetensors", "optimizer.safetensors", "state.json")
    }


def test_save_load_save_is_byte_identical(tmp_path: Path) -> None:
    params, opt = _optimizer_after_two_steps()
    named = {"a": params[0].data, "b": params[1].data}
    first = save_checkpoint(tmp_path / "one", 5, named, opt.state_dict(), {"x": 1}, keep=3)
    ckpt = load_checkpoint(first)
    assert ckpt.round == 5 and ckpt.extra == {"x": 1}
    # Rebuild an optimizer from the checkpoint alone and save it again.
    fresh = [torch.nn.Parameter(ckpt.params[n].clone(), requires_grad=False) for n in ("a", "b")]
    opt2 = default_outer_optimizer(fresh)
    opt2.load_state_dict(ckpt.optimizer_state)
    second = save_checkpoint(
        tmp_path / "two",
        5,
        {"a": fresh[0].data, "b": fresh[1].data},
        opt2.state_dict(),
        {"x": 1},
        keep=3,
    )
    assert _digest(first) == _digest(second)
    # And the restored optimizer takes the same next step as the original.
    g = [torch.ones(3, 2), torch.ones(4)]
    apply_outer_step(opt, params, g)
    apply_outer_step(opt2, fresh, [t.clone() for t in g])
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(p, q)


def test_saved_params_load_into_a_model(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    named = {n: p.detach() for n, p in model.named_parameters()}
    path = save_checkpoint(
        tmp_path,
        1,
        named,
        default_outer_optimizer(list(model.parameters())).state_dict(),
        {},
        keep=1,
    )
    other = torch.nn.Linear(3, 2)
    other.load_state_dict(load_file(str(path / "params.safetensors")))
    assert torch.equal(other.weight, model.weight)
    assert json.loads((path / "state.json").read_text())["round"] == 1


def test_rotation_keeps_the_newest(tmp_path: Path) -> None:
    params, opt = _optimizer_after_two_steps()
    for r in range(5):
        save_checkpoint(
            tmp_path,
            r,
            {"a": params[0].data},
            {"state": {}, "param_groups": opt.state_dict()["param_groups"]},
            {},
            keep=2,
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-000000003", "round-000000004"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("damage", ["no_state", "bad_json", "truncated_params"])
def test_torn_checkpoint_is_skipped(tmp_path: Path, damage: str) -> None:
    params, opt = _optimizer_after_two_steps()
    good = save_checkpoint(tmp_path, 1, {"a": params[0].data}, opt.state_dict(), {}, keep=5)
    torn = save_checkpoint(tmp_path, 2, {"a": params[0].data}, opt.state_dict(), {}, keep=5)
    if damage == "no_state":
        (torn / "state.json").unlink()
    elif damage == "bad_json":
        (torn / "state.json").write_text("{not json")
    else:
        data = (torn / "params.safetensors").read_bytes()
        (torn / "params.safetensors").write_bytes(data[: len(data) // 2])
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.path == good


def test_server_resumes_round_params_and_momentum(tmp_path: Path) -> None:
    init = {"w": torch.arange(4, dtype=torch.float32)}
    cfg = ServerConfig(port=0, num_workers=1, save_dir=str(tmp_path))
    with DiLoCoServer(cfg, initial_params=init) as srv:
        from diloco import DiLoCoClient
        from diloco.wire import TensorSpec

        client = DiLoCoClient(srv.address)
        client.register("w0")
        spec = [TensorSpec("w", "F32", (4,))]
        for r in range(2):
            client.submit_pseudogradients("w0", r, f"s{r}", spec, lambda s: torch.ones(4))
            client.get_global_params(min_round=r + 1)
        before = srv.global_params()
        opt_before = srv.coordinator.optimizer.state_dict()
    # stop() saved on shutdown; a new server resumes from it.
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(tmp_path))) as again:
        assert again.status()["round"] == 2
        assert torch.equal(again.global_params()["w"], before["w"])
        buf = again.coordinator.optimizer.state_dict()["state"][0]["momentum_buffer"]
        assert torch.equal(buf, opt_before["state"][0]["momentum_buffer"])
        assert again.coordinator.barrier.history.get("s1") == 1  # receipts survive the restart
