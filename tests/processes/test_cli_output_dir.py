"""The reference's ``diloco server -o DIR -n 1`` as a real process: the folder's PyTorch state
dict is what a worker adopts, a worker with another model is refused without being counted, a
clean shutdown saves into ``DIR/checkpoints`` and the same command line resumes from there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.cli.main import main
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow


def test_the_references_output_dir_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    torch.save(saved.state_dict(), model_dir / "pytorch_model.bin")
    args = ["-o", str(model_dir), "-n", "1", "--join-timeout", "0"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 3)  # other values: the run's are the file's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with DiLoCoWorker(model, opt, server.address, heartbeat_interval=0, sync_every=1000):
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), saved.state_dict()[name], rtol=0, atol=0)
            other = torch.nn.Linear(5, 3)
            with pytest.raises(ValueError, match="does not match the server's parameters"):
                DiLoCoWorker(
                    other, torch.optim.SGD(other.parameters(), lr=0.1), server.address
                ).start()
            st = server.status()
            assert st is not None and st["num_workers"] == 1 and len(st["workers"]) == 1
            assert main(["status", "--server", server.address]) == 0
            assert "model 15 params" in capsys.readouterr().out
        server.stop()  # SIGTERM: a clean shutdown saves
        checkpoints = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
        assert checkpoints and checkpoints[0].startswith("round-")
        server.start()
        st = server.status()
        assert st is not None and st["resumed_from"] is not None
        assert Path(st["resumed_from"]).parent == model_dir / "checkpoints"
    finally:
        server.stop()
