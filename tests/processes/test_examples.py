"""The examples of examples/ run, briefly: the plain loop with a server in its process, and the
torchrun scripts (a DDP group, a pipeline split) launched by torchrun against a real server, each
group one worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diloco import DiLoCoServer, ServerConfig
from tests.helpers.ranks import free_port

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples"
BRIEF = ["--max-steps", "12", "--sync-every", "4", "--batch-size", "8"]


@pytest.mark.timeout(60)
def test_the_plain_loop_runs() -> None:
    cmd = [sys.executable, str(EXAMPLES / "plain_loop.py"), "--embedded", *BRIEF]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'rounds': 3" in out.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "script, names",
    [
        ("torchrun_ddp.py", ["0.weight", "2.weight", "2.bias", "4.weight", "4.bias"]),
        (
            "pipeline_split.py",
            ["0.weight", "2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias"],
        ),
    ],
)
def test_the_torchrun_example_is_one_worker(script: str, names: list[str]) -> None:
    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start()
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd += [str(EXAMPLES / script), "--server", server.address, *BRIEF]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "done: worker" in out.stdout and ", 3 rounds" in out.stdout
        status = server.status()
        assert status["registrations"] == 1  # the two ranks are one worker
        assert status["round"] == 3
        # The whole model reached the server (for the pipeline: the union of both stages).
        assert sorted(server.global_params()) == sorted(names)
    finally:
        server.stop()
