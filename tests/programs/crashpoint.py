"""``diloco server`` that kills itself (SIGKILL) at one exact moment of its checkpointing.

    python -m tests.programs.crashpoint MOMENT -- server ARGS...

Moments, each counted over this process's checkpoints (``@N``: the N-th, 1-based):
- ``checkpoint_write@N``: the first file of the N-th checkpoint is on disk, the rest is not;
- ``round_folder@N``: the N-th checkpoint is complete and switched in, and nothing else has
  happened yet (its round is not published);
- ``resave@K``: a checkpoint of a round already saved by this process is being written, and the
  write is about to make its K-th rename or removal in the save dir;
- ``slow_checkpoint@N``: no kill; the N-th checkpoint takes a second longer to write (a large
  model's), so a test can kill the server from outside while it is being written;
- ``relay_upload@N``: a relay (``--upstream``) closed its N-th round on its workers'
  acknowledged uploads and is about to send the mean upstream;
- ``relay_counted@N``: the upstream counted the relay's N-th upload; its result has not come
  back, nor been published.

The hooks wrap the functions the server calls; the server's own code runs unchanged. A kill
from inside is the only way to hit a moment that lasts microseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

MARK = "CRASHPOINT"


def _die(moment: str) -> None:
    print(f"{MARK} {moment}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(moment: str) -> None:
    if moment.startswith("relay_"):
        _install_relay(moment)
        return
    import diloco.persistence.writing as persistence
    import diloco.server.rounds.checkpoints as checkpoints

    name, _, nth = moment.partition("@")
    target = int(nth) if nth else 0
    state: dict[str, Any] = {"saves": 0, "rounds": set(), "resaving": False, "files": 0, "ops": 0}
    save_checkpoint = checkpoints.save_checkpoint
    save_file = persistence.save_file

    def hooked_save_checkpoint(save_dir: Any, round: int, *args: Any, **kwargs: Any) -> Path:
        state["saves"] += 1
        state["files"] = state["ops"] = 0
        state["resaving"] = round in state["rounds"]
        try:
            path = save_checkpoint(save_dir, round, *args, **kwargs)
        finally:
            state["resaving"] = False
        state["rounds"].add(round)
        if name == "round_folder" and state["saves"] == target:
            _die(moment)
        return path

    def hooked_save_file(*args: Any, **kwargs: Any) -> None:
        if name == "slow_checkpoint" and state["saves"] == target and state["files"] == 0:
            time.sleep(1.0)
        save_file(*args, **kwargs)
        state["files"] += 1
        if name == "checkpoint_write" and state["saves"] == target and state["files"] == 1:
            _die(moment)

    def guard(fn: Any) -> Any:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if name == "resave" and state["resaving"]:
                state["ops"] += 1
                if state["ops"] == target:
                    _die(moment)
            return fn(*args, **kwargs)

        return hooked

    checkpoints.save_checkpoint = hooked_save_checkpoint  # type: ignore[assignment]
    persistence.save_file = hooked_save_file  # type: ignore[assignment]
    os.rename = guard(os.rename)  # type: ignore[assignment]
    os.replace = guard(os.replace)  # type: ignore[assignment]
    shutil.rmtree = guard(shutil.rmtree)  # type: ignore[assignment]


def _install_relay(moment: str) -> None:
    from diloco.server.relay.upstream import Upstream

    name, _, nth = moment.partition("@")
    at_moment, target = name.removeprefix("relay_"), int(nth)
    seen = {"upload": 0, "counted": 0}
    init = Upstream.__init__

    def hook(at: str, sid: str) -> None:
        seen[at] += 1
        if at == at_moment and seen[at] == target:
            _die(moment)

    def hooked_init(self: Upstream, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.at = hook

    Upstream.__init__ = hooked_init  # type: ignore[method-assign]


def main() -> int:
    moment, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.programs.crashpoint MOMENT -- server ARGS..."
    install(moment)
    from diloco.cli.main import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
