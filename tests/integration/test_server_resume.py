"""Checkpoints: atomic, rotated, pickle-free, byte-identical across save/load/save."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from diloco import DiLoCoClient, DiLoCoServer, ServerConfig
from diloco.persistence import (
    list_checkpoints,
)
from tests.helpers.persistence import unloadable_save_dir


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
        opt_before = srv.front.optimizer.state_dict()
    # stop() saved on shutdown; a new server resumes from it.
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(tmp_path))) as again:
        assert again.status()["round"] == 2
        assert torch.equal(again.global_params()["w"], before["w"])
        buf = again.front.optimizer.state_dict()["state"][0]["momentum_buffer"]
        assert torch.equal(buf, opt_before["state"][0]["momentum_buffer"])
        assert again.front.barrier.history.get("s1") == 1  # receipts survive the restart


def _server_checkpoint(where: Path) -> Path:
    """A real round-0 checkpoint of a one-tensor server."""
    cfg = ServerConfig(port=0, num_workers=1, save_dir=str(where))
    with DiLoCoServer(cfg, initial_params={"w": torch.arange(4, dtype=torch.float32)}) as srv:
        DiLoCoClient(srv.address).register("w0")  # the outer optimizer exists from here
    # stop() saved it on shutdown.
    (path,) = list_checkpoints(where)
    return path


def _copy_as(src: Path, dst: Path, round: int) -> Path:
    shutil.copytree(src, dst)
    state = json.loads((dst / "state.json").read_text())
    state["round"] = round
    (dst / "state.json").write_text(json.dumps(state))
    return dst


def _resumed_round(save_dir: Path, **kw: object) -> int | None:
    srv = DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(save_dir), **kw))  # type: ignore[arg-type]
    store = srv.front.store
    return None if store is None else store.round


def test_stale_temporaries_are_removed_at_start(tmp_path: Path) -> None:
    real = _server_checkpoint(tmp_path / "staging")
    save_dir = tmp_path / "ckpt"
    _copy_as(real, save_dir / "round-000000002", 2)
    torn_tmp = save_dir / ".tmp-round-000000003-x1"  # a save killed before state.json
    torn_tmp.mkdir()
    shutil.copy(real / "params.safetensors", torn_tmp)
    _copy_as(real, save_dir / ".old-round-000000001-x2" / "round-000000001", 1)  # a prune
    assert _resumed_round(save_dir) == 2
    assert sorted(p.name for p in save_dir.iterdir()) == ["round-000000002"]


def test_a_complete_temporary_newer_than_every_checkpoint_is_kept(tmp_path: Path) -> None:
    """What a kill during a re-save left with the code before: the only complete round 5 in a
    temporary. It is renamed into place, not thrown away."""
    real = _server_checkpoint(tmp_path / "staging")
    save_dir = tmp_path / "ckpt"
    _copy_as(real, save_dir / "round-000000004", 4)
    _copy_as(real, save_dir / ".tmp-round-000000005-x1", 5)
    assert _resumed_round(save_dir) == 5
    assert sorted(p.name for p in save_dir.iterdir()) == ["round-000000004", "round-000000005"]


def test_fresh_start_begins_anew_beside_unloadable_folders(tmp_path: Path) -> None:
    save_dir = unloadable_save_dir(tmp_path)
    cfg = ServerConfig(port=0, num_workers=1, save_dir=str(save_dir), fresh_start=True)
    with DiLoCoServer(cfg, initial_params={"w": torch.ones(2)}) as srv:
        assert srv.status()["round"] == 0
        DiLoCoClient(srv.address).register("w0")
        path = srv.save_state()
    assert path is not None and Path(path).parent == save_dir
    assert (save_dir / "round-000000003").is_dir() and (save_dir / "round-4-backup").is_dir()
    # Now one loads: the next start resumes from it, fresh start or not.
    assert _resumed_round(save_dir) == 0
