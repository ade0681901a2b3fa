"""Checkpoints back into the user's model (``load_into``: prefixes, tied weights) and out as a
model folder like the one a run began from (``export_like``, ``diloco export``)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diloco import export_like, load_into
from diloco.cli.main import main
from diloco.core.names import wire_names
from diloco.persistence import save_checkpoint
from diloco.server.params.initial import load_initial_params

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NO_OPTIMIZER: dict = {"state": {}, "param_groups": []}


class TiedLM(torch.nn.Module):
    """An output layer tied to the embedding, as GPT-2's."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as a run holds them: by wire name, each tied tensor once."""
    return {n: p.detach().clone() for n, p in wire_names(model.named_parameters()).items()}


def checkpoint_of(tmp_path: Path, params: dict[str, torch.Tensor], round: int = 12) -> Path:
    return save_checkpoint(tmp_path / "ckpt", round, params, NO_OPTIMIZER, {}, keep=3)


def test_a_tied_model_loads_in_one_call(tmp_path: Path) -> None:
    trained = TiedLM(0)
    ckpt = checkpoint_of(tmp_path, served(trained))
    assert set(load_file(str(ckpt / "params.safetensors"))) == {
        "embed.weight",
        "body.weight",
        "body.bias",
    }
    fresh = TiedLM(1)
    with pytest.raises(RuntimeError, match="head.weight"):  # what the issue reports
        fresh.load_state_dict(load_file(str(ckpt / "params.safetensors")))
    report = load_into(fresh, ckpt)
    assert fresh.head.weight is fresh.embed.weight  # still tied
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value)
    assert report.tied == {"head.weight": "embed.weight"}
    assert sorted(report.loaded) == ["body.bias", "body.weight", "embed.weight", "head.weight"]
    assert report.missing == [] and report.unexpected == []


def test_the_file_may_hold_the_tied_alias_instead(tmp_path: Path) -> None:
    trained = TiedLM(0)
    params = served(trained)
    params["head.weight"] = params.pop("embed.weight")
    fresh = TiedLM(1)
    load_into(fresh, checkpoint_of(tmp_path, params) / "params.safetensors")
    torch.testing.assert_close(fresh.embed.weight, trained.embed.weight)
    params["embed.weight"] = params["head.weight"] + 1
    save_file(params, str(tmp_path / "both.safetensors"))
    with pytest.raises(ValueError, match="one tied tensor in the model but hold different"):
        load_into(fresh, tmp_path / "both.safetensors")


def test_tied_values_are_compared_in_blocks_through_the_last_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file's two names of one tied tensor are compared a block of rows at a time (a rank
    of a sharded model never holds a whole embedding): a difference in the last block counts."""
    monkeypatch.setattr("diloco.loading.COMPARE_BYTES", 2 * 4 * 8)  # two rows of 4 per block
    params = served(TiedLM(0))
    params["head.weight"] = params["embed.weight"].clone()
    save_file(params, str(tmp_path / "same.safetensors"))
    fresh = TiedLM(1)
    load_into(fresh, tmp_path / "same.safetensors")
    torch.testing.assert_close(fresh.embed.weight, params["embed.weight"])
    params["head.weight"][-1, -1] += 1  # row 10 of 11: the sixth block
    save_file(params, str(tmp_path / "differ.safetensors"))
    with pytest.raises(ValueError, match="one tied tensor in the model but hold different"):
        load_into(fresh, tmp_path / "differ.safetensors")


def test_a_torn_file_is_an_error_naming_it(tmp_path: Path) -> None:
    save_file(served(TiedLM(0)), str(tmp_path / "whole.safetensors"))
    data = (tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(data[: len(data) - 8])
    with pytest.raises(ValueError, match=r"torn.safetensors: unreadable tensors"):
        load_into(TiedLM(1), tmp_path / "torn.safetensors")


def test_wrapped_models_and_prefixed_files_load(tmp_path: Path) -> None:
    trained = TiedLM(0)
    prefixed = {f"module.{n}": p for n, p in served(trained).items()}
    save_file(prefixed, str(tmp_path / "ddp.safetensors"))  # saved from a DDP model's state
    inner = TiedLM(1)
    load_into(torch.nn.DataParallel(torch.compile(inner)), tmp_path / "ddp.safetensors")
    torch.testing.assert_close(inner.body.weight, trained.body.weight)


def test_a_save_dir_loads_its_newest_checkpoint(tmp_path: Path) -> None:
    old, new = served(TiedLM(0)), served(TiedLM(2))
    checkpoint_of(tmp_path, old, round=3)
    checkpoint_of(tmp_path, new, round=4)
    fresh = TiedLM(1)
    load_into(fresh, tmp_path / "ckpt")
    torch.testing.assert_close(fresh.body.bias.detach(), new["body.bias"])


def test_missing_and_unexpected_names_are_reported_before_anything_is_copied(
    tmp_path: Path,
) -> None:
    params = served(TiedLM(0))
    del params["body.bias"]
    params["extra.weight"] = torch.zeros(2)
    ckpt = checkpoint_of(tmp_path, params)
    fresh = TiedLM(1)
    before = fresh.body.weight.detach().clone()
    with pytest.raises(ValueError, match=r"missing from the file \[body.bias\].*\[extra.weight\]"):
        load_into(fresh, ckpt)
    torch.testing.assert_close(fresh.body.weight.detach(), before)
    report = load_into(fresh, ckpt, strict=False)
    assert report.missing == ["body.bias"] and report.unexpected == ["extra.weight"]
    torch.testing.assert_close(fresh.body.weight, params["body.weight"])


def test_a_shape_that_differs_is_an_error(tmp_path: Path) -> None:
    params = served(TiedLM(0))
    params["body.weight"] = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"'body.weight' has shape \(4, 5\) in the file"):
        load_into(TiedLM(1), checkpoint_of(tmp_path, params))
    with pytest.raises(ValueError, match="checkpoint not found"):
        load_into(TiedLM(1), tmp_path / "nowhere")


# --- export -------------------------------------------------------------------------------------


def model_folder(path: Path) -> Path:
    """A model folder by hand: fp16 weights with an integer buffer, config, tokenizer, and an
    old-format weights file an export must not copy."""
    path.mkdir()
    tensors = {
        "embed.weight": torch.randn(11, 4).half(),
        "body.weight": torch.randn(4, 4).half(),
        "body.bias": torch.randn(4).half(),
        "position_ids": torch.arange(8),
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"hidden": 4}))
    (path / "tokenizer.json").write_text("{}")
    (path / "pytorch_model.bin").write_bytes(b"stale")
    return path


def test_export_writes_the_original_names_dtypes_and_files(tmp_path: Path) -> None:
    like = model_folder(tmp_path / "like")
    initial = load_initial_params(like)  # what diloco server --init serves
    assert "position_ids" not in initial
    trained = {n: t.float() + 1 for n, t in initial.items()}
    ckpt = checkpoint_of(tmp_path, trained)
    out = export_like(ckpt, like, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    got = load_file(str(out / "model.safetensors"))
    original = load_file(str(like / "model.safetensors"))
    assert {n: (t.shape, t.dtype) for n, t in got.items()} == {
        n: (t.shape, t.dtype) for n, t in original.items()
    }
    torch.testing.assert_close(got["position_ids"], original["position_ids"])
    torch.testing.assert_close(got["body.weight"], trained["body.weight"].half())
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match="exists"):
        export_like(ckpt, like, out)


def test_export_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    like = model_folder(tmp_path / "like")
    trained = {n: t.float() for n, t in load_initial_params(like).items()}
    trained["head.weight"] = trained.pop("embed.weight")
    with pytest.raises(
        ValueError, match=r"not in the checkpoint \[embed.weight\].*\[head.weight\]"
    ):
        export_like(checkpoint_of(tmp_path, trained), like, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_the_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    like = model_folder(tmp_path / "like")
    ckpt = checkpoint_of(tmp_path, {n: t.float() for n, t in load_initial_params(like).items()})
    out = tmp_path / "out"
    argv = ["export", "--checkpoint", str(ckpt), "--like", str(like), "--out", str(out)]
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file()
    assert main(["export", "--like", str(like), "--out", str(tmp_path / "x")]) == 2
    assert "needs --checkpoint" in capsys.readouterr().err


def test_a_swarms_save_dir_exports_its_stages_joined(tmp_path: Path) -> None:
    """A pipeline swarm's save dir holds a ``stage-K`` folder per stage, each stage's
    checkpoints at its own rounds: the export joins every stage's newest one into one model
    (the names are the unsplit model's); a name two stages hold is refused, nothing written."""
    like = model_folder(tmp_path / "like")
    trained = {n: t.float() + 1 for n, t in load_initial_params(like).items()}
    save = tmp_path / "swarm"
    stage0 = {"embed.weight": trained["embed.weight"]}
    stage1 = {n: trained[n] for n in ("body.weight", "body.bias")}
    save_checkpoint(save / "stage-0", 3, {"embed.weight": torch.zeros(11, 4)}, NO_OPTIMIZER, {}, 3)
    save_checkpoint(save / "stage-0", 4, stage0, NO_OPTIMIZER, {}, keep=3)  # the newest
    save_checkpoint(save / "stage-1", 2, stage1, NO_OPTIMIZER, {}, keep=3)  # another round
    out = export_like(save, like, tmp_path / "out")
    got = load_file(str(out / "model.safetensors"))
    for name, value in trained.items():
        torch.testing.assert_close(got[name], value.half())
    save_checkpoint(save / "stage-1", 3, {**stage1, **stage0}, NO_OPTIMIZER, {}, keep=3)
    with pytest.raises(ValueError, match="'embed.weight' is in more than one stage"):
        export_like(save, like, tmp_path / "again")
    assert not (tmp_path / "again").exists()


# --- a real GPT-2 (transformers installed) ------------------------------------------------------


def tiny_gpt2(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_gpt2_checkpoint_loads_with_its_tied_head(tmp_path: Path) -> None:
    trained = tiny_gpt2(0)
    params = served(trained)
    assert "lm_head.weight" not in params  # named_parameters() keeps the tied tensor once
    fresh = tiny_gpt2(1)
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        fresh.load_state_dict(params)
    report = load_into(fresh, checkpoint_of(tmp_path, params))
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_gpt2_run_exports_as_a_folder_from_pretrained_opens(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    original = tiny_gpt2(0)
    original.save_pretrained(tmp_path / "like")
    initial = load_initial_params(tmp_path / "like")  # diloco server --init like
    trained = {n: t + 0.5 for n, t in initial.items()}
    out = export_like(checkpoint_of(tmp_path, trained), tmp_path / "like", tmp_path / "out")
    got, before = (load_file(str(p / "model.safetensors")) for p in (out, tmp_path / "like"))
    assert {n: t.shape for n, t in got.items()} == {n: t.shape for n, t in before.items()}
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, value in served(loaded).items():
        torch.testing.assert_close(value, trained[name])


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_the_exported_folder_follows_the_umask(tmp_path: Path, mask: int) -> None:
    like = model_folder(tmp_path / "like")
    ckpt = checkpoint_of(tmp_path, {n: t.float() for n, t in load_initial_params(like).items()})
    old = os.umask(mask)
    try:
        out = export_like(ckpt, like, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~mask
