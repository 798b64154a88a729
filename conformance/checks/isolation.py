"""Isolation: tenants never see or clear each other's keys, and secrets never leak.

Namespaces: a backend whose spec names a ``namespace_option`` (``prefix`` ...) is opened twice,
with namespaces where one is a prefix of the other (``ab`` and ``abx``), the case where a plain
concatenation of prefix and key makes ``ab`` + ``xk`` and ``abx`` + ``k`` the same object.

Secrets: option values named like secrets (passwords, tokens) and URL passwords appear nowhere in
``repr``, ``stats()`` or a written conformance report.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _bytes
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, capabilities_of
from hicache_storage.conformance.report import CheckResult, Report, write_report
from hicache_storage.errors import UnsupportedOperationError
from hicache_storage.redact import secrets_in
from hicache_storage.registry import get_spec

__all__ = ["TestNamespaces", "TestSecrets"]


def _tenants(factory: BackendFactory) -> tuple[BackendFactory, BackendFactory]:
    option = get_spec(factory.name).namespace_option
    if option is None:
        pytest.skip(f"backend {factory.name!r} declares no namespace_option")
    base = f"ns{secrets.token_hex(3)}"
    return (
        dataclasses.replace(factory, options={**factory.options, option: base}),
        dataclasses.replace(factory, options={**factory.options, option: f"{base}x"}),
    )


def _clear(instance: StorageBackend) -> bool:
    try:
        instance.clear()
    except UnsupportedOperationError:
        return False
    return True


class TestNamespaces:
    """Namespaces that are prefixes of each other are disjoint, for reads, writes and clear."""

    def test_prefix_namespaces_never_share_keys(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        short, long = _tenants(hicache_factory)
        key = k("abc")
        with short() as a, long() as b:
            try:
                assert a.set(f"x{key}", b"tenant a")
                assert not b.exists(key) and b.get(key) is None, (
                    f"namespace {long.options} sees a key of namespace {short.options}: join "
                    f"prefix and key with a separator keys cannot contain"
                )
                assert b.batch_exists([key]) == 0
                assert b.set(key, b"tenant b")
                got = a.get(f"x{key}")
                assert got is not None and _bytes(got) == b"tenant a"
                got = b.get(key)
                assert got is not None and _bytes(got) == b"tenant b"
            finally:
                _clear(a)
                _clear(b)

    @pytest.mark.parametrize("cleared", ["shorter", "longer"])
    def test_clear_touches_only_its_namespace(
        self, hicache_factory: BackendFactory, k: Keyspace, cleared: str
    ) -> None:
        short, long = _tenants(hicache_factory)
        keys = k.many("c", 3)
        with short() as a, long() as b:
            try:
                assert a.batch_set(keys, [b"a"] * 3) == [True] * 3
                assert b.batch_set(keys, [b"b"] * 3) == [True] * 3
                wiper, other, kept = (a, b, b"b") if cleared == "shorter" else (b, a, b"a")
                if not _clear(wiper):
                    pytest.skip("backend does not support clear")
                assert wiper.batch_exists(keys) == 0, "clear left keys of its own namespace"
                outs = [bytearray(1) for _ in keys]
                assert other.batch_get(keys, outs) == [True] * 3, (
                    f"clear() of the {cleared} namespace removed keys of the other"
                )
                assert all(bytes(out) == kept for out in outs)
            finally:
                _clear(a)
                _clear(b)


class TestSecrets:
    """Secret option values appear in no repr, no stats and no written report."""

    def test_repr_and_stats_hide_secrets(
        self, hicache_factory: BackendFactory, backend: StorageBackend
    ) -> None:
        hidden = secrets_in(hicache_factory.options)
        if not hidden:
            pytest.skip("the options under test carry no secret")
        shown = f"{backend!r} {backend.stats()!r}"
        leaked = sorted(secret for secret in hidden if secret in shown)
        assert not leaked, "a secret option value appears in repr() or stats()"

    def test_report_hides_secrets(self, hicache_factory: BackendFactory, tmp_path: Path) -> None:
        options = {**hicache_factory.options, "password": "pw-canary-41f3"}
        hidden = secrets_in(options)
        message = f"a failure that quotes the options: {options!r}"
        report = Report(
            backend=hicache_factory.name,
            version=hicache_factory.version(),
            options=options,
            capabilities=capabilities_of(hicache_factory).claimed(),
            checks=[CheckResult(id="TestX::test_y", outcome="failed", message=message)],
        )
        written = write_report(report, tmp_path)
        for path in (written, written.with_name("report.md")):
            text = path.read_text(encoding="utf-8")
            leaked = sorted(secret for secret in hidden if secret in text)
            assert not leaked, f"{path.name} holds secret option values"
            assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
