"""The tier engine: a GPU (L1) / host (L2) / storage (L3) KV cache driven by a real transformer."""
