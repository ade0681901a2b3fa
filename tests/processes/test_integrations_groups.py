"""The trainer callbacks under a multi-process launch: two gloo ranks on CPU, started with the
variables torchrun sets, are ONE DiLoCo worker (a worker group) under the Hugging Face Trainer and
under Lightning's DDP strategy; a checkpoint written by the group and a resume from it keep it the
same worker. Each framework runs once (a module fixture: train with checkpoints, then resume in
the same processes) and the tests below read what its ranks and the server recorded. The ranks'
code is tests/programs/hf_group.py and tests/programs/lightning_ddp.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco import DiLoCoServer, ServerConfig
from diloco.wire.messages import UploadMeta
from diloco.worker import resume
from tests.helpers.ranks import free_port

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from tests.helpers import lightning as lightning_helpers  # noqa: E402
from tests.helpers.hf_setup import BATCH, logged  # noqa: E402
from tests.programs import hf_group, lightning_ddp  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(75)]
ROOT = Path(__file__).resolve().parents[2]
RANKS = 2
LAUNCH_TIMEOUT_S = 50  # a launch takes about 8 s


@dataclass
class Run:
    """What a launch left: each rank's record, the server's status and parameters at the end, and
    the weight of every upload the server received, in order."""

    out: Path
    ranks: list[dict[str, Any]]
    status: dict[str, Any]
    global_params: dict[str, torch.Tensor]
    uploads: list[tuple[str, float]]


def launch(module: str, out: Path) -> Run:
    """Start ``python -m module ADDRESS OUT`` once per rank, as torchrun would, against a server
    that weighs uploads by samples; a rank still running at the deadline is a hang."""
    uploads: list[tuple[str, float]] = []
    read_header = UploadMeta.from_metadata

    def recording(meta: dict[str, str], *, weighting: str) -> Any:
        head = read_header(meta, weighting=weighting)
        uploads.append((head.worker_id, head.weight))
        return head

    server = DiLoCoServer(ServerConfig(port=0, num_workers=1, weighting="samples"))
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UploadMeta, "from_metadata", staticmethod(recording))
        server.start()
        try:
            procs = [_start_rank(module, server.address, out, rank, port) for rank in range(RANKS)]
            _wait(procs, out)
            status, params = server.status(), server.global_params()
        finally:
            server.stop()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]
    return Run(out, ranks, status, params, uploads)


def _start_rank(module: str, address: str, out: Path, rank: int, port: int) -> Any:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(RANKS),
        "LOCAL_WORLD_SIZE": str(RANKS),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    with open(out / f"rank{rank}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, address, str(out)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait(procs: list[Any], out: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * RANKS:
        logs = "\n".join(
            f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-3000:] for r in range(RANKS)
        )
        pytest.fail(f"exit codes {codes} (a negative one: killed, hung past the deadline)\n{logs}")


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch("tests.programs.hf_group", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch("tests.programs.lightning_ddp", tmp_path_factory.mktemp("lightning"))


# --- Hugging Face Trainer --------------------------------------------------------------------


def test_hf_trainer_ranks_are_one_worker(hf_run: Run) -> None:
    g = hf_group
    ids = {r[phase]["worker_id"] for r in hf_run.ranks for phase in ("train", "resume")}
    assert len(ids) == 1 and None not in ids
    # One registration per Trainer run (rank 0's), each under the group's id.
    assert hf_run.status["registrations"] == 2
    assert {w for w, _ in hf_run.uploads} == ids
    for r in hf_run.ranks:
        history = r["train"]["history"]
        # Eight micro-batches per rank, four real steps: a sync after the third.
        steps = range(1, g.TRAIN_STEPS + 1)
        assert logged(history, "diloco/rounds") == {s: s // g.SYNC_EVERY for s in steps}
        assert logged(history, "diloco/local_step") == {s: s % g.SYNC_EVERY for s in steps}
    # Each upload weighs both ranks' samples: 2 ranks x 3 steps x 2 micro-batches of 4, then the
    # final sync's one step; resumed, the checkpoint's step (both ranks') and two more, then one.
    per_step = RANKS * g.ACCUMULATION * BATCH
    assert [w for _, w in hf_run.uploads] == [3 * per_step, per_step, 3 * per_step, per_step]
    r0, r1 = hf_run.ranks
    _assert_identical(r0["train"]["params"], r1["train"]["params"])
    # After the last (final) sync both ranks hold the server's parameters, bit for bit.
    assert hf_run.status["round"] == 4
    _assert_identical(r0["resume"]["params"], r1["resume"]["params"])
    _assert_identical(r0["resume"]["params"], hf_run.global_params)


def test_hf_trainer_checkpoint_of_a_group_holds_rank_0s_state(hf_run: Run) -> None:
    run_dir = hf_run.out / "run"
    worker_id = hf_run.ranks[0]["train"]["worker_id"]
    per_step = RANKS * hf_group.ACCUMULATION * BATCH
    # (round, local step, samples) at steps 2 and 4: the samples of both ranks since the sync.
    expected = {2: (0, 2, 2 * per_step), 4: (1, 1, per_step)}
    for step, (round_, local_step, samples) in expected.items():
        folder = run_dir / f"checkpoint-{step}"
        raw = json.loads((folder / resume.STATE_FILE).read_text())
        assert raw["worker_id"] == worker_id
        assert (raw["round"], raw["local_step"], raw["samples"]) == (round_, local_step, samples)
        assert raw["total_steps"] == step
        assert (folder / resume.SNAPSHOT_FILE).is_file()


def test_hf_trainer_group_resumes_as_the_same_worker_from_rank_0s_checkpoint(hf_run: Run) -> None:
    g = hf_group
    checkpoint = hf_run.out / "run" / f"checkpoint-{g.TRAIN_STEPS}"
    saved_model = load_file(str(checkpoint / "model.safetensors"))
    snapshot = load_file(str(checkpoint / resume.SNAPSHOT_FILE))
    r0, r1 = hf_run.ranks
    # The run moved on since the checkpoint (the final sync); the model the first run ended with
    # is that round's (were it not, this sum would miss). Rank 1 saw no worker files: rank 0's
    # checkpoint decided for both.
    now = r0["train"]["params"]
    expected = {n: now[n] + (saved_model[n] - snapshot[n]) for n in snapshot}
    _assert_identical(r0["resume"]["begin"], r1["resume"]["begin"])
    for name, value in expected.items():
        torch.testing.assert_close(r0["resume"]["begin"][name], value, rtol=1e-5, atol=1e-6)
    # The schedule goes on on both ranks: one local step was in the checkpoint, so step 6 syncs.
    for r in hf_run.ranks:
        history = r["resume"]["history"]
        resumed = {s: v for s, v in logged(history, "diloco/local_step").items() if s > 4}
        assert resumed == {5: 2, 6: 0, 7: 1}
        assert logged(history, "diloco/round")[6] == 3


# --- Lightning, DDP strategy -----------------------------------------------------------------


def test_lightning_ddp_ranks_are_one_worker(lightning_run: Run) -> None:
    g = lightning_ddp
    ids = {r[phase]["worker_id"] for r in lightning_run.ranks for phase in ("train", "resume")}
    assert len(ids) == 1 and None not in ids
    assert lightning_run.status["registrations"] == 2  # one per fit, rank 0's
    assert {w for w, _ in lightning_run.uploads} == ids
    r0, r1 = lightning_run.ranks
    for phase in ("train", "resume"):
        a, b = r0[phase]["steps"], r1[phase]["steps"]
        assert [(s["step"], s["round"], s["local_step"]) for s in a] == [
            (s["step"], s["round"], s["local_step"]) for s in b
        ]
        for x, y in zip(a, b, strict=True):
            _assert_identical(x["params"], y["params"])  # after every step, syncs included
    train = [(s["step"], s["round"], s["local_step"]) for s in r0["train"]["steps"]]
    assert train == [(s, s // g.SYNC_EVERY, s % g.SYNC_EVERY) for s in range(1, g.TRAIN_STEPS + 1)]
    # Both ranks' batches weigh in: 2 ranks x 2 steps x 8, then the final sync's one step.
    per_step = RANKS * lightning_helpers.BATCH
    assert [w for _, w in lightning_run.uploads] == [2 * per_step, 2 * per_step, per_step] * 2
    assert lightning_run.status["round"] == 6
    _assert_identical(r0["resume"]["params"], r1["resume"]["params"])
    _assert_identical(r0["resume"]["params"], lightning_run.global_params)


def test_lightning_ddp_resumes_as_the_same_worker(lightning_run: Run) -> None:
    g = lightning_ddp
    r0, r1 = lightning_run.ranks
    checkpoint = torch.load(r0["train"]["checkpoint"], weights_only=False)
    saved = checkpoint["callbacks"]["DiLoCoCallback"]
    # Rank 0's state, with both ranks' samples since the sync at step 2.
    assert saved["state"] == {
        "worker_id": r0["train"]["worker_id"],
        "round": 1,
        "local_step": 1,
        "total_steps": g.SAVE_AT,
        "samples": RANKS * lightning_helpers.BATCH,
        "tokens": 0.0,  # the batches are not language-model mappings: no tokens counted
    }
    now = r0["train"]["params"]  # the final sync's round, as the server served it
    expected = {n: now[n] + (checkpoint["state_dict"][n] - s) for n, s in saved["snapshot"].items()}
    _assert_identical(r0["resume"]["begin"], r1["resume"]["begin"])
    for name, value in expected.items():
        torch.testing.assert_close(r0["resume"]["begin"][name], value, rtol=1e-5, atol=1e-6)
    # One local step came back from the checkpoint: step 4 syncs (round 4), then every second.
    resumed = [(s["step"], s["round"], s["local_step"]) for s in r0["resume"]["steps"]]
    assert resumed == [(4, 4, 0), (5, 4, 1), (6, 5, 0), (7, 5, 1)]
