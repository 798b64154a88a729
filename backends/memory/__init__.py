"""An in-process dictionary backend: the reference implementation and the oracle for tests."""

from .backend import MemoryBackend, MemoryConfig

__all__ = ["MemoryBackend", "MemoryConfig"]
