"""The trainer callbacks against a real server, one process per worker: a tiny GPT-2 through the
Hugging Face Trainer with two workers, resuming from a Trainer checkpoint, and a small module
through lightning.Trainer, resuming from a Lightning checkpoint. Multi-process launches (a worker
group per trainer) are in test_integrations_groups.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


@pytest.mark.timeout(90)
def test_two_hf_trainers_sync_every_real_step_under_accumulation(tmp_path: Path, server_of) -> None:
    server = server_of(2)
    sync_every, steps = 3, 6
    root = Path(__file__).parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.programs.hf_worker", server.address, str(tmp_path / f"w{i}")]
            + [str(sync_every), str(steps)],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=80)
        assert p.returncode == 0, err[-3000:]
    for i in range(2):
        history = json.loads((tmp_path / f"w{i}" / "log_history.json").read_text())
        rounds = {e["step"]: e["diloco/rounds"] for e in history if "loss" in e}
        local_steps = {e["step"]: e["diloco/local_step"] for e in history if "loss" in e}
        # Twelve micro-batches, six real steps: a sync after the third and the sixth.
        assert rounds == {s: s // sync_every for s in range(1, steps + 1)}
        assert local_steps == {s: s % sync_every for s in range(1, steps + 1)}
    assert server.status()["round"] == steps // sync_every
    for i in range(2):
        params = load_file(str(tmp_path / f"w{i}" / "params.safetensors"))
        for name, value in server.global_params().items():
            torch.testing.assert_close(params[name], value)


def test_importing_diloco_imports_no_trainer_library() -> None:
    code = (
        "import sys, diloco, diloco.integrations, diloco.worker.resume; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_extra_names_what_to_install(tmp_path: Path) -> None:
    # A ``transformers`` that cannot be imported, ahead of the real one on the path.
    (tmp_path / "transformers.py").write_text("raise ImportError('absent', name='transformers')")
    code = "import diloco.integrations.transformers"
    path = [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    # diloco is on no index: the error names the installs that work, from the checkout or the
    # extra's own packages (as pyproject.toml lists them).
    assert "pip install -e '.[transformers]'" in out.stderr
    assert "pip install 'diloco[" not in out.stderr
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    for requirement in pyproject["project"]["optional-dependencies"]["transformers"]:
        assert f"'{requirement}'" in out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_train.py"])
def test_the_example_runs(tmp_path: Path, script: str) -> None:
    path = Path(__file__).parents[2] / "examples" / script
    cmd = [sys.executable, str(path), "--embedded", "--max-steps", "6", "--sync-every", "3"]
    cmd += ["--output-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
