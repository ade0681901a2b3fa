"""A checkpoint of today's layout into a freshly sharded model: FSDP2 on two gloo ranks, tensor
parallelism with FSDP2 on a 2 x 2 mesh. Every rank calls ``load_into``; each ends with its own
slice of every parameter, the full tensors equal the checkpoint's, and the errors, tied weights,
prefixes and reports are those of a plain model. Rank-side code is in
``tests/programs/load_ranks.py``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diloco import load_into
from diloco.cli.main import main
from diloco.core.names import wire_names
from diloco.persistence import save_checkpoint
from tests.helpers import ranks
from tests.programs import load_ranks as lr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NO_OPTIMIZER: dict[str, Any] = {"state": {}, "param_groups": []}


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as a run holds them: by wire name, each tied tensor once."""
    return {n: p.detach().clone() for n, p in wire_names(model.named_parameters()).items()}


def read_rank(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with safe_open(str(path), framework="pt") as fh:
        outcome = json.loads(fh.metadata()["outcome"])
    return load_file(str(path)), outcome


def shard_of(value: torch.Tensor, rank: int, world: int = 2) -> torch.Tensor:
    """Rank ``rank``'s rows under FSDP2: ``torch.chunk``, the last ranks empty when short."""
    chunks = list(torch.chunk(value, world))
    chunks += [value[:0]] * (world - len(chunks))
    return chunks[rank]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The files the FSDP2 ranks load, and the run over: a checkpoint written by the
    persistence writer as the server writes it, and variants of it."""
    root = tmp_path_factory.mktemp("fsdp")
    params = served(lr.TiedNet(seed=0))
    assert "head.weight" not in params  # tied: held once, under the embedding's name
    save_checkpoint(root / "ckpt", 3, served(lr.TiedNet(seed=5)), NO_OPTIMIZER, {}, keep=3)
    save_checkpoint(root / "ckpt", 12, params, NO_OPTIMIZER, {}, keep=3)
    # Rank 0 of layers.0.weight holds 3 rows of 5 and would hold 3 of 6 too: only the global
    # shape tells this file from the right one.
    save_file(
        {**params, "layers.0.weight": torch.zeros(6, 4)}, str(root / "wrong_shape.safetensors")
    )
    misfit = {n: v + 2 for n, v in params.items() if n != "layers.1.bias"}
    save_file({**misfit, "extra.weight": torch.zeros(2)}, str(root / "misfit.safetensors"))
    save_file({f"module.{n}": v + 1 for n, v in params.items()}, str(root / "prefixed.safetensors"))
    save_file(served(lr.TiedNet(seed=2)), str(root / "other.safetensors"))
    save_file({"w": torch.arange(4.0)}, str(root / "partial.safetensors"))
    ranks.join(ranks.spawn(lr.fsdp_rank, (str(root),)), timeout=150)
    return root, params


@pytest.mark.parametrize("rank", [0, 1])
def test_each_fsdp_rank_holds_its_slice_and_the_full_tensors_are_the_checkpoints(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], rank: int
) -> None:
    root, params = fsdp_run
    tensors, outcome = read_rank(root / f"fsdp{rank}.safetensors")
    # fully_shard keeps the model's names (no _fsdp_wrapped_module.) and the tie.
    assert outcome["names_after"] == outcome["names_before"]
    assert outcome["tied"]
    value = {**params, "head.weight": params["embed.weight"]}
    for name, expected in value.items():
        torch.testing.assert_close(tensors[f"full.{name}"], expected, rtol=0, atol=0)
        torch.testing.assert_close(
            tensors[f"local.{name}"], shard_of(expected, rank), rtol=0, atol=0
        )
        prefixed = shard_of(expected + 1, rank)
        torch.testing.assert_close(tensors[f"prefixed.{name}"], prefixed, rtol=0, atol=0)
    assert tensors["local.gate"].shape == ((1, 4) if rank == 0 else (0, 4))  # 1 row, 2 ranks
    assert tensors["local.embed.weight"].shape == ((4, 4) if rank == 0 else (3, 4))
    if rank == 1:  # loaded alone, after rank 0 had finished: no collective ran
        other = served(lr.TiedNet(seed=2))
        for name in params:
            torch.testing.assert_close(tensors[f"alone.{name}"], shard_of(other[name], 1))


def test_the_fsdp_model_reports_and_refuses_as_a_plain_one(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, params = fsdp_run
    plain = lr.TiedNet(seed=1)
    plain_report = asdict(load_into(plain, root / "ckpt"))
    plain_loose = asdict(load_into(lr.TiedNet(seed=1), root / "misfit.safetensors", strict=False))
    for rank in range(2):
        tensors, outcome = read_rank(root / f"fsdp{rank}.safetensors")
        assert outcome["report"] == plain_report
        assert outcome["report"]["tied"] == {"head.weight": "embed.weight"}
        assert outcome["loose"] == plain_loose
        assert outcome["loose"]["missing"] == ["layers.1.bias"]
        assert outcome["loose"]["unexpected"] == ["extra.weight"]
        assert (
            "'layers.0.weight' has shape (6, 4) in the file and (5, 4) in the model"
            in (outcome["shape_error"])
        )
        assert (
            "missing from the file [layers.1.bias], not in the model [extra.weight]"
            in (outcome["strict_error"])
        )
        assert "'w' is a DTensor that cannot be loaded" in outcome["partial_error"]
        assert "partial" in outcome["partial_error"]
        for name in params:  # the refused loads copied nothing
            assert torch.equal(tensors[f"after_errors.{name}"], tensors[f"fresh.{name}"]), name
        # strict=False copied what fits, and left the bias it lacks as it was.
        torch.testing.assert_close(
            tensors["loose.layers.0.weight"], shard_of(params["layers.0.weight"] + 2, rank)
        )
        assert torch.equal(tensors["loose.layers.1.bias"], tensors["fresh.layers.1.bias"])


def test_a_checkpoint_of_an_fsdp_models_parameters_exports(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A run whose worker was an FSDP2 model holds that model's names (rank 0's full tensors,
    by wire name, as a worker uploads them); ``diloco export`` writes it as a folder like one
    saved from the plain model."""
    root, params = fsdp_run
    tensors, outcome = read_rank(root / "fsdp0.safetensors")
    run = wire_names((n, tensors[f"full.{n}"]) for n in outcome["names_after"])
    assert set(run) == set(params)
    ckpt = save_checkpoint(tmp_path / "run", 7, run, NO_OPTIMIZER, {}, keep=3)
    like = tmp_path / "like"
    like.mkdir()
    original = {n: v.half() for n, v in served(lr.TiedNet(seed=9)).items()}
    save_file(original, str(like / "model.safetensors"), metadata={"format": "pt"})
    (like / "config.json").write_text("{}")
    out = tmp_path / "out"
    argv = ["export", "--checkpoint", str(ckpt), "--like", str(like), "--out", str(out)]
    assert main(argv) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(original)
    for name, value in exported.items():
        assert value.dtype == torch.float16
        torch.testing.assert_close(value, params[name].half(), rtol=0, atol=0)


def test_tensor_parallel_and_fsdp_on_a_2d_mesh(tmp_path: Path) -> None:
    source = lr.make_tp(seed=0)
    params = served(source)
    save_file(params, str(tmp_path / "tp.safetensors"))
    ranks.join(ranks.spawn(lr.tp_rank, (str(tmp_path),), nprocs=4), timeout=150)
    for rank in range(4):
        tensors, outcome = read_rank(tmp_path / f"tp{rank}.safetensors")
        assert outcome["names_after"] == outcome["names_before"] == list(params)
        assert outcome["report"]["loaded"] == list(params)
        # The column-parallel weight is strided (FSDP2 over TP on one dimension), the
        # row-parallel one a 2-D box: both layouts are exercised.
        assert "_StridedShard" in outcome["placements"]["0.weight"]
        assert "Shard(dim=1)" in outcome["placements"]["2.weight"]
        for name, value in params.items():
            torch.testing.assert_close(tensors[f"full.{name}"], value, rtol=0, atol=0)
            local, expected = tensors[f"local.{name}"], tensors[f"expected.{name}"]
            assert local.shape == expected.shape, (rank, name)
            torch.testing.assert_close(local, expected, rtol=0, atol=0)
