"""The DiLoCo parameter server."""

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer

__all__ = ["DiLoCoServer", "ServerConfig"]
