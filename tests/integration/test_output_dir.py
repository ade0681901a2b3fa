"""``-o/--output-dir`` on a running server: the model in the folder (a PyTorch state dict here)
is the run's initial parameters, checkpoints go to its ``checkpoints`` folder, a restart
resumes from there, and a folder without a model waits for the first worker's."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers.http import TIMEOUT, accept, assert_params_equal, body, register, url
from tests.helpers.servers import initial_params


def config(**kw: object) -> ServerConfig:
    return ServerConfig(port=0, num_workers=1, join_timeout=0.0, **kw)  # type: ignore[arg-type]


def close_round_0(server: DiLoCoServer) -> None:
    register(server, "w-1")
    accept(server, body("w-1", 0, "s-0"))
    # The long poll returns once round 1 is published: the close is the event waited on.
    resp = requests.get(url(server, "/global_params?min_round=1&worker_id=w-1"), timeout=TIMEOUT)
    assert resp.status_code == 200


def test_the_folders_model_starts_the_run_and_its_checkpoints_resume_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    torch.save(initial_params(), model / "pytorch_model.bin")
    with DiLoCoServer(config(output_dir=str(model))) as server:
        assert_params_equal(server.global_params(), initial_params())
        close_round_0(server)
        trained = server.global_params()
        saved = Path(server.save_state() or "")
    assert saved.parent == model / "checkpoints"
    with DiLoCoServer(config(output_dir=str(model))) as again:  # resumes, not the .bin
        st = again.status()
        assert st["round"] == 1 and st["resumed_from"] is not None
        assert Path(st["resumed_from"]).parent == model / "checkpoints"
        assert_params_equal(again.global_params(), trained)


def test_a_folder_without_a_model_waits_for_the_first_worker(tmp_path: Path) -> None:
    out = tmp_path / "new-run"  # need not exist yet
    with DiLoCoServer(config(output_dir=str(out))) as server:
        assert server.status()["has_params"] is False
        register(server, "w-1")
        resp = requests.post(
            url(server, "/initial_params?worker_id=w-1"),
            data=body(None, None, None, initial_params()),
            headers={"Content-Type": "application/octet-stream", "X-Diloco-Client": "test"},
            timeout=TIMEOUT,
        )
        assert resp.status_code == 200, resp.text
        saved = Path(server.save_state() or "")
    assert saved.parent == out / "checkpoints"


def test_init_takes_the_place_of_the_folders_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    torch.save(initial_params(), model / "model.pt")
    other = {n: t + 1 for n, t in initial_params().items()}
    torch.save(other, tmp_path / "other.pt")
    with DiLoCoServer(
        config(output_dir=str(model), initial_params=str(tmp_path / "other.pt"))
    ) as s:
        assert_params_equal(s.global_params(), other)
        assert s.status()["save_dir"] == str(model / "checkpoints")


def test_a_folder_it_cannot_choose_from_is_an_error_at_start(tmp_path: Path) -> None:
    for name in ("a.pt", "b.pt"):
        torch.save(initial_params(), tmp_path / name)
    with pytest.raises(ValueError, match=r"several state dict files \(a\.pt, b\.pt\)"):
        DiLoCoServer(config(output_dir=str(tmp_path)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--output-dir must be a folder"):
        DiLoCoServer(config(output_dir=str(tmp_path / "file")))
