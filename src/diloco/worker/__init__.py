"""The worker side: ``DiLoCoWorker`` wraps any training loop through an optimizer post-step hook.

The top level is the worker's lifecycle (``worker.py``: hook, register, heartbeats, re-join,
leave), its settings, the ``Session`` it shares with its sync strategy, the ``SyncStrategy``
protocol and the one place a strategy is chosen (``choose.py``), checkpoint resume, the log, the
SIGTERM handler (``termination.py``) and the optimizer found under wrappers (``unwrap.py``).
Below it: ``transport/`` (the HTTP client), ``state/`` (the model, its snapshot, the upload
encoder), and the strategy families ``server_mode/`` (plain and streaming), ``allreduce/`` (the
quorum loop and its payloads) and ``groups/`` (torch.distributed ranks as one worker).
"""

from diloco.worker.settings import WorkerSettings
from diloco.worker.transport.client import (
    Conflict,
    DiLoCoClient,
    ServerError,
    UnknownWorker,
    Unreachable,
)
from diloco.worker.worker import DiLoCoWorker

__all__ = [
    "Conflict",
    "DiLoCoClient",
    "DiLoCoWorker",
    "ServerError",
    "UnknownWorker",
    "Unreachable",
    "WorkerSettings",
]
