"""The two utilization figures of ``compute_utilization``: their definitions (printed with the
figures), the step time of a training step alone that the strict one needs, and the table and
verdicts.

lenient: time in the training steps (``optimizer.step()`` and the sleep, inside the loop) / wall.
A step that the sync's CPU work slows (a background encode on a shared core) counts as training.
strict: steps x step time / wall, the step time measured alone (no worker attached): whatever the
sync adds to a step, or between steps, counts as idle.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

from benchmarks.harness.report import print_table

CALIBRATION_STEPS = 10
"""Steps each worker times alone (after one untimed) for the strict figure's step time."""
LENIENT = (
    "lenient: time in the training steps (optimizer.step and the sleep, inside the loop) / wall"
)
STRICT = "strict: steps x step time / wall (step time: one step timed alone, no worker attached)"


def step_alone(model: Any, step_time: float) -> float:
    """The time of one training step with no worker attached, s: the mean of
    ``CALIBRATION_STEPS`` steps (``optimizer.step()`` on fixed fake gradients, then the sleep) on
    a copy of ``model``, after one untimed step. A copy, so that the worker's model starts where
    the server's initial parameters say. The mean, not the median: the lenient figure sums the
    loop's steps, load spikes included, and a median would drop them from the strict one only."""
    import torch

    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    for p in twin.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    times = []
    for k in range(CALIBRATION_STEPS + 1):
        t0 = time.perf_counter()
        opt.step()
        time.sleep(step_time)
        if k:  # the first step pays first-touch costs the loop's steps no longer do
            times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def report(
    results: list[dict[str, Any]], rates: list[float], *, reference: str, target: float
) -> None:
    """Print the definitions, the table (both figures side by side, with the step times they
    rest on) and per rate the best configuration by each figure against ``target``."""
    print(f"Utilization, {LENIENT}; {STRICT}.")
    print()
    print_table(
        [
            "link MB/s",
            "configuration",
            "utilization, lenient",
            "utilization, strict",
            "step alone ms",
            "step in loop ms",
            "round s",
            "sync s / round",
            "MB up / round",
            "MB down / round",
        ],
        [
            [
                f"{r['rate_mb_s']:g}",
                r["config"],
                f"{r['utilization']:.1%}",
                f"{r['strict']:.1%}",
                f"{r['step_alone_ms']:.0f}",
                f"{r['step_in_loop_ms']:.0f}",
                f"{r['round_s']:.2f}",
                f"{r['sync_s_per_round']:.2f}",
                f"{r['mb_up_per_round']:.1f}",
                f"{r['mb_down_per_round']:.1f}",
            ]
            for r in results
        ],
    )
    print()
    for rate in rates:
        rows = [r for r in results if r["rate_mb_s"] == rate]
        ref = next((r for r in rows if r["config"] == reference), None)
        ref_txt = f"; {reference}: {ref['utilization']:.1%} / {ref['strict']:.1%}" if ref else ""
        for key in ("utilization", "strict"):
            best = max(rows, key=lambda r: float(r[key]))  # noqa: B023 - used at once
            verdict = "reaches" if best[key] >= target else "misses"
            print(
                f"{rate:g} MB/s, {'lenient' if key == 'utilization' else 'strict'}: best "
                f"{best['config']} {best[key]:.1%} ({verdict} {target:.0%}){ref_txt}"
            )
