"""The one-GPU profile (issue 32, item 5): one configuration at its own scale, sized for a
15-minute device session, and its section of docs/quality.md.

    python benchmarks/quality/run.py gpu_profile --profile gpu --time-limit 540

The profile (``protocol.GPU``) is a byte transformer of about 19M parameters on CPython's
standard-library sources, on ``cuda``. The scale (``GPU_SCALE``): a 2000-step pretrain, then
DiLoCo with M = 4 workers (threads sharing the GPU) for 2000 inner steps each at H = 50 (40
outer steps), beside one-worker AdamW for the same 2000 steps from the same start, one seed,
every row at the profile's inner lr (the CPU suite's lr sweep is not run at this scale: it
would not fit the session). Run as
``--profile cpu --fast`` (or at any profile with ``--fast``) it is the wiring test's tiny run.

``--time-limit`` bounds the training: past it every training loop stops at its next sync
boundary (or curve point), the row says ``stopped_early`` and is not cached, and rows not yet
started are skipped (listed in the result file's ``skipped``). The pretrain (cached) and the
evaluations after a row are not cut: leave room for them. The results file,
``gpu_profile.json``, goes beside the CPU suite's; the page shows it in its own section, never
in the claims table (its scale and model are not the CPU suite's).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from benchmarks.quality.experiments import DEFAULT, Config, Scale, adamw, plain
from benchmarks.quality.stats import Results, fmt, names, paired, rows, values

GPU_SCALE = replace(
    DEFAULT,
    steps=2000,
    sync_every=50,
    workers=4,
    pretrain_steps=2000,
    warmup=100,
    windows=256,
    curve_points=20,
    seeds=(0,),
)
EXPERIMENT = "gpu_profile"


def gpu_profile(s: Scale) -> list[Config]:
    """The one-GPU profile's configuration: DiLoCo with M workers at H for the scale's inner steps
    per worker, beside one-worker AdamW for the same steps (the first row, the reference)."""
    return [adamw(s, s.steps, "AdamW, 1 worker (equal steps)"), plain(s)]


def section(results: Results) -> list[str]:
    """The page's lines for the GPU run when its result file is there, else what to run."""
    res = results.get(EXPERIMENT)
    if res is None:
        return [
            "## One-GPU profile (not run)",
            "",
            "No GPU run's results are here. `python benchmarks/quality/run.py gpu_profile "
            "--profile gpu --time-limit 540` runs it on a machine with one CUDA GPU (one "
            "command; training stops 540 s after it starts, the 2000-step pretrain before it is "
            "not cut) and writes `gpu_profile.json` beside the CPU results; "
            "`tests/integration/test_quality_gpu.py` runs the same code at a tiny scale on the "
            "CPU.",
            "",
        ]
    profile, scale = res["profile"], res["scale"]
    lines = [
        "## One-GPU profile",
        "",
        *(
            ["**Fast-setting results (a smoke test), not the profile's figures.**", ""]
            if res.get("fast")
            else []
        ),
        f"Byte transformer, {profile['layers']} layers, width {profile['d_model']}, "
        f"{profile['heads']} heads, context {profile['seq_len']}, batch {profile['batch_size']}, "
        f"inner lr {profile['lr']} (not swept), on `{profile['device']}`; the stdlib corpus. "
        f"Pretrain {scale['pretrain_steps']} steps, then {scale['steps']} inner steps per "
        f"worker at H = {scale['sync_every']}, M = {scale['workers']}. Command: "
        f"`{res['command']}`; it took {res['elapsed_s']:.0f} s.",
        "",
        "| configuration | eval loss | vs first row (paired) | inner steps per worker | wall s |",
        "|---|---|---|---|---|",
    ]
    ref = names(res)[0]
    for n in names(res):
        group = rows(res, n)
        diff = "reference" if n == ref else fmt(paired(res, n, ref), signed=True)
        steps = ", ".join(_steps(r) for r in group)
        wall = fmt([r["wall_s"] for r in group], 1)
        lines.append(f"| {n} | {fmt(list(values(res, n).values()))} | {diff} | {steps} | {wall} |")
    if res.get("skipped"):
        lines += ["", "Not run within the time limit: " + ", ".join(res["skipped"]) + "."]
    return [*lines, ""]


def _steps(row: dict[str, Any]) -> str:
    steps = f"{row['steps_per_worker']:.0f}"
    return steps + " (stopped at the time limit)" if row.get("stopped_early") else steps
