"""Every experiment the suite knows, by name: ``experiments.py``'s (claims a-o) and those that
live in their own modules (``muon.py``, claim p; ``quorum.py``, claim q; ``gpu.py``, the one-GPU profile, no claim).

Not run on its own; ``run.py``, ``render.py`` and the tests read ``EXPERIMENTS`` here. Kept apart
from ``experiments.py`` because those modules build on it (its ``Config`` and ``plain``).
"""

from __future__ import annotations

from benchmarks.quality.experiments import EQUAL_STEPS, Experiment
from benchmarks.quality.experiments import EXPERIMENTS as BASE
from benchmarks.quality.gpu import EXPERIMENT as GPU_EXPERIMENT
from benchmarks.quality.gpu import GPU_SCALE, gpu_profile
from benchmarks.quality.muon import muon
from benchmarks.quality.quorum import quorum

EXPERIMENTS: dict[str, Experiment] = {
    **BASE,
    "muon": Experiment(
        "muon", "p", muon, "equal steps and equal total tokens (global batch split)"
    ),
    "quorum": Experiment(
        "quorum", "q", quorum, "equal total inner steps over all workers (one at 1/4 speed)"
    ),
    GPU_EXPERIMENT: Experiment(
        GPU_EXPERIMENT, "", gpu_profile, EQUAL_STEPS, default=False, scale=GPU_SCALE
    ),
}
# Experiments outside the CPU suite: not run by a bare ``run.py``, not in the claims or setup.
APART = (GPU_EXPERIMENT,)
