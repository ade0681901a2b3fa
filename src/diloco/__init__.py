"""diloco: DiLoCo training across machines joined by ordinary networks."""

from diloco.export import export_like
from diloco.loading import load_into
from diloco.server import DiLoCoServer, ServerConfig
from diloco.worker import DiLoCoClient, DiLoCoWorker, WorkerSettings

__all__ = [
    "DiLoCoClient",
    "DiLoCoServer",
    "DiLoCoWorker",
    "ServerConfig",
    "WorkerSettings",
    "export_like",
    "load_into",
]
__version__ = "0.1.0"
