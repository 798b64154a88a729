"""Any backend served from its own storage process, over the engine's shared host pool."""

from .backend import ProcessBackend
from .config import ProcessConfig

__all__ = ["ProcessBackend", "ProcessConfig"]
