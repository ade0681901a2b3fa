"""One worker, one server killed (SIGKILL) at one chosen moment, restarted from its save dir.

Shared by ``tests/processes/test_crash_moments.py`` (every moment once, asserted) and
``benchmarks/faults/crash_moments.py`` (every moment many times, tallied).

The ledger: the worker trains with a constant gradient (SGD, lr 1), so each inner step moves
every element by exactly ``-G``; the server's outer step is plain SGD with lr 1 and one worker
contributes to each round, so every round adds that worker's progress to the global parameters.
Whatever happens, once the worker has synced its last step the global parameters must be
``init - (steps - dropped) * G``, where ``dropped`` is what the worker counted as dropped: a step
lost without being counted, or counted twice, shows up as a multiple of ``G``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors.torch import save_file

from diloco import DiLoCoClient, DiLoCoWorker
from tests.helpers.faultproxy import Fault, FaultProxy
from tests.helpers.procs import ServerProcess

G = 0.125  # every element moves by -G per inner step
SYNC_EVERY = 3
MOMENTS = (
    "mid_upload",
    "after_accepted",
    "checkpoint_write",
    "mid_download",
    "round_folder",
    "resave@2",  # the new copy is written; the old one is about to go (or to be switched)
    "resave@3",  # ... and the old one is being removed
)


def crashpoint(moment: str, kill_round: int) -> str | None:
    """The server-side hook (tests/programs/crashpoint.py) of a moment killed in upload ``kill_round``. A
    download is cut (and the server killed) while that round's checkpoint takes a second to
    write, as a large model's does: a round whose bytes left before its checkpoint was on disk
    would then be lost."""
    if moment in ("checkpoint_write", "round_folder"):
        return f"{moment}@{kill_round}"
    if moment == "mid_download":
        return f"slow_checkpoint@{kill_round}"
    if moment.startswith("resave"):
        return moment
    return None


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # 129 KiB of payload: cuts of a few KB fall inside the tensors, and a download's first bytes
    # leave before its last 64 KiB, which the server sends only once the round is final.
    return {"weight": torch.randn(256, 128, generator=g), "bias": torch.randn(256, generator=g)}


class HookedWorker(DiLoCoWorker):
    """Calls ``before(n)`` and ``after(n, reply)`` around its n-th upload (1-based)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uploads = 0
        self.before: Callable[[int], None] = lambda n: None
        self.after: Callable[[int, dict[str, Any]], None] = lambda n, reply: None

    def _submit(self, submission_id: str) -> dict[str, Any]:
        self.uploads += 1
        n = self.uploads
        self.before(n)
        reply = super()._submit(submission_id)
        self.after(n, reply)
        return reply


@dataclass
class Outcome:
    moment: str
    killed: bool  # the server died at the moment (SIGKILL)
    hung: bool  # the worker did not finish
    errors: list[str]
    resumed: bool  # the restarted server loaded a checkpoint
    steps: int
    dropped: int  # steps the worker counted as dropped
    missing: float  # steps absent from the global parameters, less those counted as dropped
    exact: bool  # every element moved by exactly the steps not dropped
    in_sync: bool  # the worker's model equals the served parameters
    seconds: float


def run(
    tmp_path: Path,
    moment: str,
    *,
    kill_round: int = 2,
    steps: int = 12,
    cut: int = 2000,
    restart_timeout: float = 60.0,
) -> Outcome:
    """Train ``steps`` steps (a sync every ``SYNC_EVERY``), killing the server at ``moment`` of
    upload ``kill_round`` (>= 2: the first round's checkpoint exists), then restart it."""
    t0 = time.monotonic()
    init = initial()
    save_file(init, str(tmp_path / "init.safetensors"))
    common = [
        "--init",
        str(tmp_path / "init.safetensors"),
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--save-every",
        "1",
        "--keep",
        "1",  # the tightest setting: one bad switch or prune leaves nothing to resume from
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
        "--poll-timeout",
        "2",
    ]
    log = tmp_path / "server.log"
    first = ServerProcess(["--port", "0", *common], log, crash_at=crashpoint(moment, kill_round))
    box: dict[str, ServerProcess] = {"server": first}
    port = first.port
    proxy = FaultProxy(port) if moment in ("mid_upload", "mid_download") else None
    address = proxy.address if proxy is not None else first.address

    def kill() -> None:
        box["server"].kill9()

    model = torch.nn.Linear(128, 256)
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    client = DiLoCoClient(address, retries=40, backoff=0.05, max_backoff=0.5, read_timeout=30)
    worker = HookedWorker(
        model,
        opt,
        address,
        sync_every=SYNC_EVERY,
        bf16_comm=False,
        worker_id="w",
        heartbeat_interval=0,
        client=client,
    )
    _arm(moment, kill_round, cut, worker, proxy, box, kill)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with worker:
                for _ in range(steps):
                    for p in model.parameters():
                        p.grad = torch.full_like(p, G)
                    opt.step()
                    opt.zero_grad()
                worker.force_sync()  # every step handed in and its round adopted
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    killed, resumed, in_sync, exact, missing = False, False, False, False, float("nan")
    try:
        try:  # the kill, by a hook above or by the server itself at its crash point
            killed = box["server"].wait_exit(timeout=restart_timeout) == -9
        except Exception:
            pass
        if killed:
            box["server"] = ServerProcess(["--port", str(port), *common], log)
        thread.join(90)
        if killed and not thread.is_alive() and not errors:
            status = DiLoCoClient(box["server"].address).status()
            resumed = status["resumed_from"] is not None
            _, got = DiLoCoClient(box["server"].address).get_global_params()
            dropped = int(worker.sync_metrics["dropped_steps"])
            moved = torch.cat([(init[n] - got[n]).flatten() for n in init]) / G
            missing = steps - dropped - float(moved.mean())
            exact = float((moved - (steps - dropped)).abs().max()) < 1e-3
            in_sync = all(torch.equal(model.state_dict()[n], got[n]) for n in got)
    finally:
        if proxy is not None:
            proxy.close()
        box["server"].stop()
        thread.join(5)
    return Outcome(
        moment,
        killed,
        thread.is_alive(),
        [repr(e) for e in errors],
        resumed,
        steps,
        int(worker.sync_metrics["dropped_steps"]),
        missing,
        exact,
        in_sync,
        time.monotonic() - t0,
    )


def _arm(
    moment: str,
    k: int,
    cut: int,
    worker: HookedWorker,
    proxy: FaultProxy | None,
    box: dict[str, ServerProcess],
    kill: Callable[[], None],
) -> None:
    """Set the hook that kills the server at ``moment`` of the worker's k-th upload."""
    if moment == "mid_upload":
        assert proxy is not None
        up = Fault("up", cut, b"POST /submit_pseudograd", then=kill)
        worker.before = lambda n: proxy.add(up) if n == k else None
    elif moment == "mid_download":
        assert proxy is not None
        proxy.add(Fault("down", 2 * cut, f"GET /global_params?min_round={k}".encode(), then=kill))
    elif moment == "after_accepted":
        # A second registered worker that never uploads, registered while round k-2 is open (it
        # is not expected there), keeps round k-1 open after the worker's upload is accepted:
        # the server then holds it in memory only.
        holder = DiLoCoClient(box["server"].address, retries=0)

        def hold(n: int) -> None:
            if n == k - 1:
                holder.register("holder")
                holder.heartbeat("holder")

        def after(n: int, reply: dict[str, Any]) -> None:
            if n == k:
                assert reply["status"] == "accepted" and reply["round"] == k - 1
                kill()

        worker.before, worker.after = hold, after
    elif moment.startswith("resave"):

        def resave(n: int, reply: dict[str, Any]) -> None:
            if n == k:  # round k closed and saved; an operator asks for a save of it again
                url = f"http://{box['server'].address}/control/save_state"
                try:
                    answer = requests.post(
                        url, json={}, headers={"X-Diloco-Client": "1"}, timeout=30
                    )
                except requests.ConnectionError:
                    return  # the server died saving, as it should
                raise AssertionError(f"save_state answered {answer.status_code}: {answer.text}")

        worker.after = resave
