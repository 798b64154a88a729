"""The ``hicache`` command line: list backends and benchmark them against raw baselines."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
