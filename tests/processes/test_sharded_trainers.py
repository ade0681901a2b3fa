"""The trainer callbacks on FSDP2-sharded models under ``torchrun`` (two gloo ranks on CPU): the
examples examples/hf_fsdp2.py (a Hugging Face Trainer on a model the script shards itself) and
examples/lightning_fsdp2.py (Lightning's ``ModelParallelStrategy``, checkpointed and resumed)
each run as ONE sharded DiLoCo worker against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from diloco import DiLoCoServer, ServerConfig
from diloco.integrations.lightning import SHARD_DIR
from diloco.worker import resume
from tests.helpers.ranks import free_port

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
BRIEF = ["--sync-every", "2", "--batch-size", "8"]


def torchrun(script: str, server: DiLoCoServer, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += [str(EXAMPLES / script), "--server", server.address, *BRIEF, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _worker_id(out: subprocess.CompletedProcess[str]) -> str:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("done: worker "))
    assert line.endswith("parameters ['DTensor']")  # the model stayed sharded
    return line.split()[2].rstrip(",")


@pytest.mark.timeout(150)
def test_hf_trainer_on_an_fsdp2_model_is_one_sharded_worker(tmp_path: Path) -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        out = torchrun("hf_fsdp2.py", server, "--max-steps", "6", "--output-dir", str(tmp_path))
        status, names = server.status(), sorted(server.global_params())
    _worker_id(out)
    assert out.stderr.count("worker group of 2 ranks (sharded)") == 2
    assert status["registrations"] == 1 and status["round"] == 3
    assert "transformer.h.1.mlp.c_fc.weight" in names and "transformer.wte.weight" in names


@pytest.mark.timeout(200)
def test_lightning_fsdp2_checkpoint_resumes_as_the_same_worker(tmp_path: Path) -> None:
    """Five steps with a checkpoint at step 3, then a new launch from it to step 7: rank 0's
    worker state is in the checkpoint, each rank's snapshot boxes beside it, and the resumed
    group is the same worker with the checkpoint's one local step on top of the newest round."""
    ckpt = tmp_path / "ckpt" / "step=3.ckpt"
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        common = ["--output-dir", str(tmp_path)]
        first = torchrun(
            "lightning_fsdp2.py", server, "--max-steps", "5", "--save-every", "3", *common
        )
        again = torchrun(
            "lightning_fsdp2.py", server, "--max-steps", "7", "--resume", str(ckpt), *common
        )
        status = server.status()
    assert _worker_id(first) == _worker_id(again)
    for out in (first, again):
        assert out.stderr.count("worker group of 2 ranks (sharded)") == 2
    assert status["round"] == 6  # rounds at steps 2, 4, 5 (final sync); 4, 6, 7 resumed
    # Both ranks resumed: the checkpoint's step 3 is one local step past round 1.
    resumed = "resumed: 1 local steps since round 1 kept on top of round 3"
    assert again.stderr.count(resumed) == 2
    meta: dict[str, Any] = torch.load(ckpt / "meta.pt", weights_only=False)
    saved = meta["callbacks"]["DiLoCoCallback"]
    assert saved["state"]["worker_id"] == _worker_id(first)
    assert (saved["state"]["round"], saved["state"]["local_step"]) == (1, 1)
    assert saved["state"]["samples"] == 2 * 8  # both ranks' batch since the sync
    shard_dir = tmp_path / SHARD_DIR / "step=3"
    assert saved["snapshot_dir"] == str(shard_dir) and "snapshot" not in saved
    # Each rank's file holds half of the sharded rows of the first layer, not the model.
    for r in range(2):
        with safe_open(str(shard_dir / f"diloco_snapshot.rank{r}.safetensors"), "pt") as f:
            assert f.get_slice("net.0.weight").get_shape() == [128, 32]


@pytest.mark.timeout(150)
def test_hf_trainer_sharded_checkpoint_resumes_as_the_same_worker(tmp_path: Path) -> None:
    """Each rank's Trainer checkpoints into its own folder (as on machines with their own
    disks): rank 0's holds the worker state and its shard, rank 1's its shard alone. Resumed,
    both ranks are the same worker, each with its own checkpoint's progress on top of the round
    the server serves now. Rank-side code: tests/programs/hf_fsdp2_resume.py."""
    from tests.programs import hf_fsdp2_resume as g

    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd += ["-m", "tests.programs.hf_fsdp2_resume", server.address, str(tmp_path)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-4000:]
        status = server.status()
    assert out.stderr.count("worker group of 2 ranks (sharded)") == 4
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ids = {rank[phase]["worker_id"] for rank in ranks for phase in ("train", "resume")}
    assert len(ids) == 1 and None not in ids
    assert status["round"] == 4  # a sync at 3, the final one at 4; resumed at 6 and 7
    checkpoints = [tmp_path / f"rank{r}" / f"checkpoint-{g.TRAIN_STEPS}" for r in range(2)]
    assert (checkpoints[0] / resume.STATE_FILE).is_file()
    assert not (checkpoints[1] / resume.STATE_FILE).exists()  # rank 0's state decided
    for r, rank in enumerate(ranks):
        assert rank["resume"]["local_step"] == g.TRAIN_STEPS % g.SYNC_EVERY
        snapshot = checkpoints[r] / f"diloco_snapshot.rank{r}.safetensors"
        with safe_open(str(snapshot), "pt") as f:
            saved = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        now = rank["train"]["end"]  # the final sync's round, which the resume joined
        for name, (shard, _) in rank["resume"]["begin"].items():
            expected = now[name][0] + (rank["resume"]["loaded"][name][0] - saved[name])
            torch.testing.assert_close(shard, expected, rtol=1e-5, atol=1e-6, msg=name)
