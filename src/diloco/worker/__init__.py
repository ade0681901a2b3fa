"""The worker side: HTTP client and the optimizer-hook wrapper."""

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
