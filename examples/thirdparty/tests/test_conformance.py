"""Run the hicache-storage conformance suite against example-sqlite, the importable way.

Importing the suite brings every check and fixture into this module; the one thing it needs from
us is ``hicache_factory``: which registered backend to build, with which options.
"""

from __future__ import annotations

import pytest

from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.suite import *  # noqa: F403


@pytest.fixture(scope="session")
def hicache_factory(tmp_path_factory: pytest.TempPathFactory) -> BackendFactory:
    """example-sqlite over one database file shared by every check (keys never collide)."""
    path = tmp_path_factory.mktemp("example-sqlite") / "kv.sqlite3"
    return BackendFactory("example-sqlite", {"path": str(path), "timeout_s": 5.0})
