"""One configuration of the goodput benchmark run under the chaos schedule: a ``diloco server``
process and one process per worker slot (``goodput_worker.py``), and a monitor that reads
``/status`` every ``POLL_S`` and fires each fault when its point of training is reached
(``goodput_schedule.py``, counted by ``step_ledger.py``).

How each fault is made:

* kill: ``SIGKILL`` the slot's process, start a new life at once under the same id; it resumes
  from the slot's newest checkpoint (written at every sync);
* straggler: the slot's shared slowdown factor, which the worker applies after every step;
* freeze: ``SIGSTOP``, then ``SIGCONT`` the given seconds later. The whole process stops, its
  heartbeat thread too: what a hung machine, a swapped-out process or a preempted VM looks
  like to the server, which sees silence and evicts the worker after ``--heartbeat-timeout``.
  (A loop that stops stepping but keeps its heartbeat is the ``--stuck-timeout`` case, a
  different path, not this one.) Thawed, the worker finds itself evicted, rejoins and rebases;
* server: ``SIGKILL`` the server and start it again on its port; with ``--save-every 1`` it
  resumes from the last round it published.

The global model is fetched at most every ``FETCH_S`` when the round moved, timestamped from the
moment every worker had registered, and evaluated on the held-out text after the run (so the
evaluation takes no CPU from the workers while they train).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks.faults.goodput_schedule import Fault
from benchmarks.faults.goodput_worker import Counters, train
from benchmarks.faults.step_ledger import StepLedger
from benchmarks.harness.processes import reap
from benchmarks.harness.server_process import ServerProcess

POLL_S = 0.2
FETCH_S = 0.5


def run(
    name: str,
    server_args: list[str],
    sync: bool,
    cfg: dict[str, Any],
    faults: tuple[Fault, ...],
    workdir: Path,
) -> dict[str, Any]:
    """Train ``cfg['workers']`` slots of ``cfg['steps']`` inner steps each against a server
    started with ``server_args`` (``sync``: its rounds close behind a barrier or a quorum, not
    per upload), firing ``faults``; what was measured, with the global model at each fetch."""
    import torch
    from safetensors.torch import save_file

    from diloco.demo.model import build_model
    from diloco.worker import DiLoCoClient

    workdir.mkdir(parents=True, exist_ok=True)
    n, per_round = cfg["workers"], cfg["workers"] * cfg["sync_every"]
    init = workdir / "init.safetensors"
    model = build_model(cfg["seed"])
    save_file({k: p.detach().contiguous() for k, p in model.named_parameters()}, str(init))
    server = ServerProcess(
        [
            *["--num-workers", str(n), "--save-dir", str(workdir / "ckpt"), "--save-every", "1"],
            *["--heartbeat-timeout", str(cfg["heartbeat_timeout"]), "--poll-timeout", "5"],
            *["--init", str(init), *server_args],
        ],
        workdir / "server.log",
    )
    cfg = {**cfg, "workdir": str(workdir)}
    ctx = mp.get_context("spawn")
    counters = Counters.make(ctx, n)

    def life(slot: int) -> Any:
        p = ctx.Process(target=train, args=(slot, cfg, server.address, counters), daemon=True)
        p.start()
        return p

    procs = {slot: life(slot) for slot in range(n)}
    ledger = StepLedger(sync)
    pending = sorted(faults, key=lambda f: f.at)
    fired: list[dict[str, Any]] = []
    armed: dict[int, Fault] = {}  # slot -> its fault, once the worker reaches its park step
    frozen: dict[int, float] = {}  # slot -> when to thaw it
    restarting: dict[int, tuple[float, int, dict[str, Any]]] = {}  # slot -> kill time, computed
    client = DiLoCoClient(server.address, retries=2, read_timeout=30)
    fetched: list[tuple[float, int, int, dict[str, torch.Tensor]]] = []
    t0: float | None = None
    last_fetch, fetched_round = 0.0, -1
    deadline = time.monotonic() + cfg["deadline_s"]
    try:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{name}: the run took more than {cfg['deadline_s']} s")
            status = server.status(history_since=ledger.since())
            if status is not None:
                ledger.observe(status)
                if t0 is None and len(status["workers"]) >= n:
                    t0 = now  # every worker has registered: training starts
            reached = ledger.reached()
            # In order: none fires while an earlier one waits for its worker's step.
            while pending and not armed and t0 is not None and reached >= pending[0].at * per_round:
                fault = pending.pop(0)
                if fault.offset and fault.worker is not None:  # at the worker's step, below
                    counters.park[fault.worker] = counters.computed[fault.worker] + fault.offset
                    armed[fault.worker] = fault
                    continue
                fired.append(
                    _fire(fault, procs, counters, frozen, restarting, server, ledger, life)
                )
                fired[-1].update(t=round(now - t0, 2), reached=reached)
            for slot, fault in list(armed.items()):
                if (
                    counters.computed[slot] >= counters.park[slot]
                    or procs[slot].exitcode is not None
                ):
                    del armed[slot]
                    fired.append(
                        _fire(fault, procs, counters, frozen, restarting, server, ledger, life)
                    )
                    fired[-1].update(t=round(now - (t0 or now), 2), reached=reached)
            for slot in [s for s, t in frozen.items() if now >= t]:
                os.kill(procs[slot].pid, signal.SIGCONT)
                del frozen[slot]
            for slot, (killed_at, computed, record) in list(restarting.items()):
                if counters.computed[slot] > computed:  # the new life took its first step
                    record["restart_s"] = round(time.monotonic() - killed_at, 2)
                    del restarting[slot]
            if status is not None and t0 is not None and status["round"] != fetched_round:
                if now - last_fetch >= FETCH_S:
                    try:
                        fetched_round, params = client.get_global_params()
                    except Exception:  # noqa: BLE001 - a server restarting: the next poll
                        continue
                    # Its own clock: a server restart above may have taken seconds since ``now``.
                    last_fetch = time.monotonic()
                    fetched.append((last_fetch - t0, fetched_round, ledger.reached(), params))
            bad = [s for s, p in procs.items() if p.exitcode not in (None, 0)]
            if bad and not any(s in restarting for s in bad):
                raise RuntimeError(f"{name}: worker {bad[0]} exited {procs[bad[0]].exitcode}")
            if all(p.exitcode == 0 for p in procs.values()) and not frozen and not armed:
                break
        wall = time.monotonic() - (t0 or 0.0)
        final = server.status(history_since=ledger.since())
        assert final is not None, "the server stopped answering"
        ledger.observe(final)
        last_round, params = client.get_global_params()
        fetched.append((wall, last_round, ledger.reached(), params))
    finally:
        client.close()
        for slot in frozen:
            os.kill(procs[slot].pid, signal.SIGCONT)
        reap(list(procs.values()))
        server.stop()
    computed = sum(counters.computed[:])
    timed = sum(counters.timed[:])
    return {
        "name": name,
        "server_args": server_args,
        "faults": fired,
        "not_fired": [f.describe() for f in pending],
        "rounds": final["round"],
        "computed": computed,
        "reached": ledger.reached(),
        "reached_per_worker": ledger.per_worker(),
        "lost_in_kills": sum(f.get("lost", 0) for f in fired),
        "dropped": sum(counters.dropped[:]),
        "step_s": sum(counters.compute_s[:]) / timed if timed else None,
        "server_restarts": server.starts - 1,
        "worker_deaths": final["worker_deaths"],
        "wall_s": round(wall, 2),
        "fetched": fetched,
    }


def _fire(
    fault: Fault,
    procs: dict[int, Any],
    counters: Counters,
    frozen: dict[int, float],
    restarting: dict[int, tuple[float, int, dict[str, Any]]],
    server: ServerProcess,
    ledger: StepLedger,
    life: Any,
) -> dict[str, Any]:
    """Make one fault happen; what it did, for the report."""
    record: dict[str, Any] = {"fault": fault.describe()}
    slot = fault.worker
    if slot is not None and procs[slot].exitcode is not None:
        record["skipped"] = "the worker had already finished"
        counters.park[slot] = 0
        return record
    if fault.kind == "kill":
        assert slot is not None
        os.kill(procs[slot].pid, signal.SIGKILL)
        procs[slot].join()
        killed_at = time.monotonic()
        record["lost"] = counters.computed[slot] - counters.at_checkpoint[slot]
        restarting[slot] = (killed_at, counters.computed[slot], record)
        counters.park[slot] = 0
        procs[slot] = life(slot)
    elif fault.kind in ("slow", "fast"):
        assert slot is not None
        counters.slow[slot] = fault.factor if fault.kind == "slow" else 1.0
    elif fault.kind == "freeze":
        assert slot is not None
        os.kill(procs[slot].pid, signal.SIGSTOP)
        counters.park[slot] = 0  # it goes on from its park step once thawed
        frozen[slot] = time.monotonic() + fault.seconds
    else:
        t = time.monotonic()
        server.kill9()
        server.start()  # same port; resumes from its save dir
        status = None
        while status is None:
            status = server.status()
        record["restart_s"] = round(time.monotonic() - t, 2)
        record["resumed_round"] = status["round"]
        ledger.server_restarted(int(status["round"]))
    return record
