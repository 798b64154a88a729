"""Deliberately wrong backends: the conformance suite must fail every one of them.

Each backend has exactly one bug and names the check meant to catch it. The modules here group
them by what they start from: ``dict_bugs`` (an in-memory dictionary), ``reference`` (a correct
one-file-per-key backend written with :mod:`hicache_storage.kit`, the starting point of the
file-based bugs) and one module per area of the contract. ``tests/test_teeth.py`` runs the
suite against each and checks that its check is among the failures.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from hicache_storage import BackendSpec, Capabilities

__all__ = ["MODULES", "REFERENCE", "Bug", "all_bugs", "bug"]

MODULES = (
    "dict_bugs",
    "semantic_bugs",
    "data_bugs",
    "latent_bugs",
    "batch_bugs",
    "deadline_bugs",
    "trust_bugs",
)
"""The modules that declare ``BUGS``; the plugin registers every one of them."""


@dataclass(frozen=True)
class Bug:
    """A broken backend and the check (an id substring of the suite) that must catch it."""

    spec: BackendSpec
    caught_by: str


def bug(
    name: str,
    factory: str,
    description: str,
    caught_by: str,
    *,
    config: str = "tests.broken_backends.dict_bugs:BrokenConfig",
    capabilities: Capabilities | None = None,
) -> Bug:
    """Declare broken backend ``name`` built by ``factory`` (``module:Class``)."""
    spec = BackendSpec(
        name=name,
        factory=factory,
        config=config,
        capabilities=capabilities if capabilities is not None else Capabilities(delete=True),
        description=description,
    )
    return Bug(spec, caught_by)


REFERENCE = BackendSpec(
    name="reference-file",
    factory="tests.broken_backends.reference:FilePerKey",
    config="tests.broken_backends.reference:FilePerKeyConfig",
    capabilities=Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
    ),
    description="correct one-file-per-key backend written with the kit (the bugs' base)",
)
"""The correct backend the file-based bugs start from; it must pass the whole suite."""


def all_bugs() -> list[Bug]:
    """Return the bugs every module in :data:`MODULES` declares."""
    found: list[Bug] = []
    for module in MODULES:
        found.extend(importlib.import_module(f"{__name__}.{module}").BUGS)
    return found
