"""Layers: wrappers that add one cross-cutting behaviour to any backend, same contract out."""

from __future__ import annotations

from .attach import AttachingBackend
from .base import AnsweringLayer, ForwardingBackend
from .degrade import DegradeLayer
from .faults import FaultInjectionLayer
from .health import HealthLayer
from .metrics import MetricsLayer
from .outcomes import watch_planner
from .quota import QuotaLayer
from .validation import ValidationLayer
from .verify import VerifyLayer

__all__ = [
    "AnsweringLayer",
    "AttachingBackend",
    "DegradeLayer",
    "FaultInjectionLayer",
    "ForwardingBackend",
    "HealthLayer",
    "MetricsLayer",
    "QuotaLayer",
    "ValidationLayer",
    "VerifyLayer",
    "watch_planner",
]
