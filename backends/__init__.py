"""Built-in storage backends, registered through ``hicache_storage.backends`` entry points."""
