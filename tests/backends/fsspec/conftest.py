"""Fixtures of the fsspec backend's tests: the S3 tests' SeaweedFS server, reused for s3://."""

from __future__ import annotations

from typing import Any

import pytest

from hicache_storage.backends.s3 import provision
from hicache_storage.kit.services import LocalService

from ..s3.conftest import s3_service

__all__ = ["s3_service", "s3_url_options"]


@pytest.fixture
def s3_url_options(s3_service: LocalService, request: pytest.FixtureRequest) -> dict[str, Any]:
    """fsspec options reaching the server's bucket under a prefix private to this test.

    The deadline stays the default (10 s), as the s3 backend's suite runs it: on the loaded
    2-core CI machine one ``PutObject`` to SeaweedFS has taken longer than 5 s.
    """
    if not s3_service.running():  # a fault check may have left it stopped
        s3_service.start()
    options = s3_service.options
    prefix = "f-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return {
        "url": f"s3://{options['bucket']}/{prefix}",
        "storage_options": {
            "endpoint_url": options["endpoint_url"],
            "key": provision.TEST_ACCESS_KEY,
            "secret": provision.TEST_SECRET_KEY,
            "client_kwargs": {"region_name": options["region"]},
        },
    }
