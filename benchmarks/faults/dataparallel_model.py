"""The data-parallel baseline of the goodput benchmark: a model of synchronous data-parallel
training under the chaos schedule, not a run.

Data-parallel training takes one step on every live worker, then averages the gradients; a step
is done when the slowest live worker's is. The model follows the run step by step on a simulated
clock, with these rules:

1. **Steps.** Each step, every live worker computes one inner step (``computed`` += live
   workers); it takes ``step_s`` times the largest slowdown factor among the live workers (a
   straggler at 1/4 speed makes every step 4 times as long). Averaging the gradients costs
   nothing: the all-reduce's time is left out, in the baseline's favour.
2. **Checkpoints.** Every ``checkpoint_every`` steps the model is saved; what the steps since the
   last save contributed is then safe.
3. **Kill.** The collective fails and every worker goes back to the last checkpoint: the steps
   every worker computed since it are lost (computed, never reached), the run waits
   ``restart_s`` (the killed worker's replacement starting), then goes on with all workers.
4. **Freeze** for ``seconds``. Every worker waits inside the collective: ``seconds`` when the
   worker thaws before ``heartbeat_timeout``, and no work is lost. Otherwise the run waits
   ``heartbeat_timeout``, then evicts it and goes on without it (no rollback: an idealised
   elastic restart, again in the baseline's favour); it rejoins at the first step after it thaws.
5. **Server restart.** The rendezvous every worker needs is gone: the run stalls for
   ``server_restart_s``; nothing is lost.
6. **When faults fire.** As in the runs (``goodput_schedule.py``): fault ``at=k`` fires once
   ``k * workers * sync_every`` inner steps are in the model, and ``offset`` steps later where it
   has one (every worker steps together here), once each, before the step that would follow. A run ends when ``steps`` steps are in the model (each worker slot's budget,
   as in the runs, where each worker trains ``steps`` inner steps).

Goodput is ``reached / computed``: the inner steps whose gradients are in the final model over
the inner steps computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.faults.goodput_schedule import Fault


@dataclass(frozen=True)
class Costs:
    """The times the model is built from (measured in the runs, see ``benchmarks/goodput.py``)."""

    step_s: float
    """One inner step's compute on one worker."""
    restart_s: float
    """From a worker's kill until its replacement computes again."""
    server_restart_s: float
    """From the server's kill until it serves again."""
    heartbeat_timeout: float
    """How long a silent worker is waited for before it is evicted."""
    checkpoint_every: int
    """Steps between checkpoints."""


@dataclass
class Outcome:
    """What the model says of a run."""

    wall_s: float = 0.0
    computed: int = 0
    reached: int = 0
    rollbacks: int = 0
    stall_s: float = 0.0
    log: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.reached / self.computed if self.computed else 0.0


def simulate(
    workers: int, steps: int, sync_every: int, faults: tuple[Fault, ...], costs: Costs
) -> Outcome:
    """Data-parallel training of ``steps`` steps on ``workers`` workers under ``faults`` (the
    module docstring's rules); ``sync_every`` places the faults (rule 6)."""
    out = Outcome()
    pending = sorted(faults, key=lambda f: f.at)
    slow = [1.0] * workers
    out_until: dict[int, float] = {}  # evicted worker -> when it thaws
    done = 0  # steps in the model (a rollback takes them back)
    saved = 0  # steps at the last checkpoint
    since_save = 0  # inner steps computed since the last checkpoint, all workers
    in_model = 0  # inner steps in the model
    while done < steps:
        while pending and in_model >= (pending[0].at * sync_every + pending[0].offset) * workers:
            fault = pending.pop(0)
            _fire(fault, out, slow, out_until, costs)
            if fault.kind == "kill":
                out.log.append(f"step {done}: rollback to {saved}, {since_save} steps lost")
                out.rollbacks += 1
                in_model -= since_save
                done, since_save = saved, 0
        for w in [w for w, t in out_until.items() if out.wall_s >= t]:
            del out_until[w]  # thawed: rejoins at this step
        live = [w for w in range(workers) if w not in out_until]
        out.wall_s += costs.step_s * max(slow[w] for w in live)
        out.computed += len(live)
        since_save += len(live)
        in_model += len(live)
        done += 1
        if done % costs.checkpoint_every == 0:
            saved, since_save = done, 0
    out.reached = in_model
    return out


def _fire(
    fault: Fault, out: Outcome, slow: list[float], out_until: dict[int, float], costs: Costs
) -> None:
    """Apply one fault to the clock and the workers (rules 3-5; a kill's rollback is the
    caller's)."""
    if fault.kind == "kill":
        stall = costs.restart_s
    elif fault.kind == "slow":
        assert fault.worker is not None
        slow[fault.worker], stall = fault.factor, 0.0
    elif fault.kind == "fast":
        assert fault.worker is not None
        slow[fault.worker], stall = 1.0, 0.0
    elif fault.kind == "freeze":
        assert fault.worker is not None
        stall = min(fault.seconds, costs.heartbeat_timeout)
        if fault.seconds > costs.heartbeat_timeout:
            out_until[fault.worker] = out.wall_s + fault.seconds
    else:
        stall = costs.server_restart_s
    out.wall_s += stall
    out.stall_s += stall
    out.log.append(f"{fault.describe()}: stall {stall:g} s")
