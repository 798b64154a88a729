"""The one name of torchvision.transforms.functional SGLang's model configs import."""

import enum
from typing import NoReturn


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"torchvision stand-in: functional.{name} is not available in tests")
