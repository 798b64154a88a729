"""Test-only stand-in for torchvision: see tests/sglang/helpers.py for why it exists."""

from . import transforms

__version__ = "0.0.0+stand-in"
__all__ = ["transforms"]
