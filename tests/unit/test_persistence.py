"""Checkpoints: atomic, rotated, pickle-free, byte-identical across save/load/save."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco import DiLoCoServer, ServerConfig
from diloco.core import apply_outer_step, default_outer_optimizer
from diloco.persistence import (
    inspect_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_stale_temporaries,
    resume_checkpoint,
    save_checkpoint,
)
from tests.helpers.persistence import unloadable_save_dir


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




# --- checkpoints are transactions (issue 15, findings 2 and 3) ---------------------------------


def _save(root: Path, r: int, keep: int = 3, tag: str = "") -> Path:
    """A small checkpoint of round ``r`` whose parameters say which round (and save) wrote it."""
    return save_checkpoint(
        root,
        r,
        {"w": torch.full((3,), float(r))},
        {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        {"tag": tag},
        keep=keep,
    )


class Killed(BaseException):
    """The process died at this step: neither it nor any later change to the disk happens."""


def _die_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """From the ``step``-th rename or folder removal on, the process is dead."""
    calls = 0

    def gate(real: Callable[..., object]) -> Callable[..., object]:
        def dying(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls >= step:
                raise Killed
            return real(*args, **kwargs)

        return dying

    monkeypatch.setattr(os, "rename", gate(os.rename))
    monkeypatch.setattr(os, "replace", gate(os.replace))
    monkeypatch.setattr(shutil, "rmtree", gate(shutil.rmtree))


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_a_kill_at_any_step_of_a_resave_keeps_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: int, keep: int
) -> None:
    """A graceful stop right after a periodic save writes round 5 again. Killed at any step of
    that, the save dir still holds a complete round 5 (the first or the second copy), never
    only round 4 or nothing."""
    _save(tmp_path, 4, keep)
    _save(tmp_path, 5, keep, tag="first")
    with monkeypatch.context() as m:
        _die_at(m, step)
        with contextlib.suppress(Killed):
            _save(tmp_path, 5, keep, tag="second")
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.round == 5
    assert found.extra["tag"] in ("first", "second")
    # The next start clears what the kill left and resumes the same round; saving goes on.
    remove_stale_temporaries(tmp_path)
    resumed = resume_checkpoint(tmp_path)
    assert resumed is not None and resumed.round == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    _save(tmp_path, 6, keep)
    assert [load_checkpoint(p).round for p in list_checkpoints(tmp_path)] == [4, 5, 6][-keep:]


def test_a_resave_supersedes_the_same_round(tmp_path: Path) -> None:
    """The second save of a round takes a new folder; the first goes only after it is written,
    and does not take one of the ``keep`` places."""
    _save(tmp_path, 4)
    _save(tmp_path, 5, tag="first")
    second = _save(tmp_path, 5, tag="second")
    assert second.name == "round-000000005.1"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-000000004", second.name]
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.path == second and found.extra["tag"] == "second"


def test_a_torn_folder_under_the_rounds_name_moves_the_save_to_a_suffix(tmp_path: Path) -> None:
    """A ``.N`` suffix appears when round N's name is taken: by an earlier save of the same round
    or by a torn folder, which is never written over; each further save takes the next N, and
    the generation it supersedes goes once it is written."""
    torn = tmp_path / "round-000000005"
    torn.mkdir()
    first = _save(tmp_path, 5, tag="first")
    assert first.name == "round-000000005.1" and torn.is_dir()
    second = _save(tmp_path, 5, tag="second")
    assert second.name == "round-000000005.2" and not first.exists() and torn.is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == [second.name]
    assert json.loads((second / "state.json").read_text())["generation"] == 2


def test_a_torn_folder_never_costs_a_new_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn ``round-000000057`` with keep 1 used to make every new checkpoint be deleted
    right after it was written."""
    torn = tmp_path / "round-000000057"
    torn.mkdir()
    (torn / "params.safetensors").write_bytes(b"\0" * 16)
    for r in range(3):
        _save(tmp_path, r, keep=1)
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.round == 2
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-000000002"]
    assert torn.is_dir()  # reported and left alone: it is the operator's to look at
    assert "round-000000057" in caplog.text and "state.json" in caplog.text
    # Saving the torn folder's own round writes beside it, never over it.
    at57 = _save(tmp_path, 57, keep=1)
    assert at57 != torn and torn.is_dir() and load_checkpoint(at57).round == 57


def test_pruning_goes_by_content_not_name(tmp_path: Path) -> None:
    """A complete checkpoint of round 1 under the name of round 99 is older than round 5."""
    staged = _save(tmp_path / "staging", 1)
    shutil.copytree(staged, tmp_path / "round-000000099")
    new = _save(tmp_path, 5, keep=1)
    assert list_checkpoints(tmp_path) == [new]
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.round == 5


def test_a_truncated_tensor_file_is_not_counted(tmp_path: Path) -> None:
    good = _save(tmp_path, 1)
    torn = _save(tmp_path, 2)
    data = (torn / "optimizer.safetensors").read_bytes()
    (torn / "optimizer.safetensors").write_bytes(data[:-1])
    assert list_checkpoints(tmp_path) == [good]
    with pytest.raises(ValueError, match="optimizer.safetensors"):
        inspect_checkpoint(torn)


def test_a_true_copy_travels_in_the_transaction(tmp_path: Path) -> None:
    """A lossy downlink's true copy: saved beside the parameters, loaded back, and part of what
    makes a checkpoint complete."""
    params, opt = _optimizer_after_two_steps()
    named = {"a": params[0].data, "b": params[1].data}
    true = {n: t + 1 for n, t in named.items()}
    plain = save_checkpoint(tmp_path, 1, named, opt.state_dict(), {}, keep=3)
    assert load_checkpoint(plain).true_params is None
    path = save_checkpoint(tmp_path, 2, named, opt.state_dict(), {}, keep=3, true=true)
    loaded = load_checkpoint(path).true_params
    assert loaded is not None and all(torch.equal(loaded[n], true[n]) for n in true)
    data = (path / "true.safetensors").read_bytes()
    (path / "true.safetensors").write_bytes(data[:-1])
    assert list_checkpoints(tmp_path) == [plain]
    with pytest.raises(ValueError, match="true.safetensors"):
        inspect_checkpoint(path)














def test_server_refuses_to_start_when_no_checkpoint_loads(tmp_path: Path) -> None:
    save_dir = unloadable_save_dir(tmp_path)
    with pytest.raises(ValueError, match="none can be loaded") as info:
        DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(save_dir)))
    message = str(info.value)
    for name, why in [
        ("round-000000003", "state.json"),
        ("round-000000004", "not valid JSON"),
        ("round-4-backup", "foreign"),
    ]:
        line = next(line for line in message.splitlines() if name + ":" in line)
        assert why in line
    assert "--fresh-start" in message


def test_cli_refuses_to_start_naming_each_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco.cli.main import main

    save_dir = unloadable_save_dir(tmp_path)
    monkeypatch.setattr(DiLoCoServer, "run", lambda self: None)  # never serve, whatever happens
    assert main(["server", "--port", "0", "--save-dir", str(save_dir)]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in ("round-000000003", "round-000000004", "round-4-backup"))
    assert main(["server", "--port", "0", "--save-dir", str(save_dir), "--fresh-start"]) == 0


