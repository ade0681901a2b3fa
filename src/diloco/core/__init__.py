"""Pure tensor maths of DiLoCo: no I/O, no threads, no clocks."""

from diloco.core.accumulate import WeightedSum
from diloco.core.outer import (
    apply_outer_step,
    default_outer_optimizer,
    optimizer_hparams,
    set_optimizer_hparams,
)
from diloco.core.pseudo_gradient import (
    adopt_,
    merge_,
    pseudo_gradient,
    pseudo_gradient_pieces,
    rebase_,
    to_progress_,
)

__all__ = [
    "WeightedSum",
    "adopt_",
    "apply_outer_step",
    "default_outer_optimizer",
    "merge_",
    "optimizer_hparams",
    "pseudo_gradient",
    "pseudo_gradient_pieces",
    "rebase_",
    "set_optimizer_hparams",
    "to_progress_",
]
