"""The names SGLang's model configs touch at import time; anything else raises."""

from typing import NoReturn

from . import functional
from .functional import InterpolationMode


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"torchvision stand-in: transforms.{name} is not available in tests")


__all__ = ["InterpolationMode", "functional"]
