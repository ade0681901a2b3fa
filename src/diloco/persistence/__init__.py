"""Checkpoints of the run's state: safetensors for tensors, JSON for everything else, no pickle
(the one ``torch.load``, with ``weights_only=True``, reads a user's own state dict file in
``weights``).

The server mode's checkpoints and all-reduce mode's (written by rank 0 of a quorum) share this
layout, so this package imports nothing else of diloco. ``folders`` says what a checkpoint folder
holds, ``writing`` how one is written as a transaction, ``reading`` which folders count and how
the newest loadable one is found, ``optimizer_states`` how several optimizers share one state, ``weights`` a user's model weights
(safetensors or a PyTorch state dict).
"""

from diloco.persistence.folders import (
    FORMAT,
    TRUE_FILE,
    Checkpoint,
    Entry,
    NoLoadableCheckpoint,
)
from diloco.persistence.optimizer_states import merge_states, split_states
from diloco.persistence.reading import (
    inspect_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    scan,
)
from diloco.persistence.writing import remove_stale_temporaries, save_checkpoint

__all__ = [
    "FORMAT",
    "TRUE_FILE",
    "Checkpoint",
    "Entry",
    "NoLoadableCheckpoint",
    "inspect_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "merge_states",
    "remove_stale_temporaries",
    "resume_checkpoint",
    "save_checkpoint",
    "scan",
    "split_states",
]
