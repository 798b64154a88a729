"""Adapters that let serving engines load hicache-storage backends.

``sglang`` makes any backend an SGLang HiCache storage backend (``docs/sglang.md``); ``vllm``
makes it a storage tier of vLLM's KV offloading (``docs/vllm.md``). Each adapter imports its
engine only inside itself, so importing :mod:`hicache_storage` never needs an engine installed.
"""
