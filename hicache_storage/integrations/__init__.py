"""Adapters that let serving engines load hicache-storage backends (``docs/sglang.md``).

Each adapter lives in its own module and imports its engine only there, so importing
:mod:`hicache_storage` never needs an engine installed.
"""
