"""``--init`` and ``--output-dir``'s initial model: safetensors as before, and PyTorch state dict
files through the restricted loader only, with an error naming the file for anything else."""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco import export_like
from diloco.persistence import save_checkpoint
from diloco.persistence.weights import weight_files
from diloco.server.params.initial import load_initial_params


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_a_state_dict_file_loads_like_safetensors(tmp_path: Path, suffix: str) -> None:
    want = tensors()
    torch.save({**want, "position_ids": torch.arange(4)}, tmp_path / f"model{suffix}")
    save_file(want, str(tmp_path / "same.safetensors"))
    assert_same(load_initial_params(tmp_path / f"model{suffix}"), want)  # integers skipped
    assert_same(load_initial_params(tmp_path / "same.safetensors"), want)


def test_a_hugging_face_folder_with_pytorch_model_bin(tmp_path: Path) -> None:
    want = tensors()
    torch.save(want, tmp_path / "pytorch_model.bin")
    torch.save({"lr": torch.tensor(0.1)}, tmp_path / "optimizer.pt")  # not guessed from
    (tmp_path / "config.json").write_text("{}")
    assert weight_files(tmp_path) == [tmp_path / "pytorch_model.bin"]
    assert_same(load_initial_params(tmp_path), want)


def test_safetensors_win_over_a_bin_in_the_same_folder(tmp_path: Path) -> None:
    want = tensors()
    save_file(want, str(tmp_path / "model.safetensors"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"never read")
    assert_same(load_initial_params(tmp_path), want)


def test_several_state_dict_files_are_not_guessed_from(tmp_path: Path) -> None:
    torch.save(tensors(), tmp_path / "a.pt")
    torch.save(tensors(), tmp_path / "b.pt")
    with pytest.raises(ValueError, match=r"several state dict files \(a\.pt, b\.pt\).*--init FILE"):
        load_initial_params(tmp_path)


def test_the_single_nested_state_dict_is_used_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    want = tensors()
    torch.save({"model_state_dict": want, "epoch": 3, "lr": 0.1}, tmp_path / "ckpt.pt")
    with caplog.at_level(logging.WARNING, logger="diloco"):
        assert_same(load_initial_params(tmp_path / "ckpt.pt"), want)
    assert "under key 'model_state_dict'" in caplog.text


def test_several_nested_state_dicts_are_refused_naming_the_keys(tmp_path: Path) -> None:
    torch.save({"model": tensors(), "ema": tensors()}, tmp_path / "ckpt.pt")
    with pytest.raises(
        ValueError, match=r"ckpt\.pt: holds several state dicts \(under 'model', 'ema'\)"
    ):
        load_initial_params(tmp_path / "ckpt.pt")


@pytest.mark.parametrize(
    ("content", "found"),
    [
        ([torch.zeros(2)], "holds a list, not a state dict"),
        ({"w": torch.zeros(2), "step": 5}, "not a flat state dict .* key 'step' holds a int"),
        ({}, "holds an empty dict"),
    ],
)
def test_what_is_not_a_flat_tensor_dict_is_named(
    tmp_path: Path, content: object, found: str
) -> None:
    torch.save(content, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match=f"odd.pt: {found}"):
        load_initial_params(tmp_path / "odd.pt")


class Payload:
    """Unpickling it would run code: the restricted loader must refuse before it does."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.getenv, ("DILOCO_NEVER_SET",))


@pytest.mark.parametrize("content", [Payload(), collections.OrderedDict(w=Payload())])
def test_objects_are_refused_by_the_restricted_loader(tmp_path: Path, content: object) -> None:
    torch.save(content, tmp_path / "evil.pt")
    with pytest.raises(
        ValueError,
        match=r"evil\.pt: not a PyTorch state dict that torch\.load\(weights_only=True\) reads",
    ):
        load_initial_params(tmp_path / "evil.pt")


def test_a_file_that_is_no_checkpoint_at_all(tmp_path: Path) -> None:
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"junk\.bin: not a PyTorch state dict"):
        load_initial_params(tmp_path / "junk.bin")


def test_tied_weights_are_kept_once_under_their_first_name(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's lm_head and wte
    torch.save(model.state_dict(), tmp_path / "tied.pt")
    got = load_initial_params(tmp_path / "tied.pt")
    assert list(got) == [n for n, _ in model.named_parameters()] == ["0.weight"]


def test_a_run_begun_from_pytorch_model_bin_exports_as_safetensors(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    model.half()
    like = tmp_path / "like"
    like.mkdir()
    torch.save(model.state_dict(), like / "pytorch_model.bin")
    (like / "config.json").write_text("{}")
    initial = load_initial_params(like)  # what --init like serves
    trained = {n: t.float() + 1 for n, t in initial.items()}
    ckpt = save_checkpoint(tmp_path / "ckpt", 3, trained, {"state": {}, "param_groups": []}, {}, 1)
    out = export_like(ckpt, like, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    assert {n: t.dtype for n, t in got.items()} == {"0.weight": torch.float16}
    torch.testing.assert_close(got["0.weight"], trained["0.weight"].half())


def test_a_folder_of_shards_or_of_one_state_dict_file(tmp_path: Path) -> None:
    want = tensors()
    shards = tmp_path / "shards"
    shards.mkdir()
    torch.save({"w": want["w"]}, shards / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": want["b"]}, shards / "pytorch_model-00002-of-00002.bin")
    torch.save({"x": torch.zeros(1)}, shards / "training_args.bin")  # not a shard: not read
    assert_same(load_initial_params(shards), want)
    single = tmp_path / "single"
    single.mkdir()
    torch.save(want, single / "weights.pth")
    assert_same(load_initial_params(single), want)
