"""Shared host memory: mappings are found while alive and forgotten once released, never hanging."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hicache_storage.hostpool import shared
from hicache_storage.hostpool.shared import region_of, shared_zeros


def test_a_mapping_is_found_while_alive_and_forgotten_once_released() -> None:
    tensor = shared_zeros(8192, pin=False)
    region = region_of(tensor[4096:])
    assert region is not None and region.nbytes == 8192 and region.offset == 4096
    base = tensor.data_ptr()
    del tensor, region
    assert region_of(shared_zeros(4096, pin=False)) is not None
    with shared._lock:
        shared._forget_dead()
        assert all(alive() is not None for _, _, alive in shared._mappings.values())
        assert base not in shared._mappings or shared._mappings[base][2]() is not None


def test_a_release_run_by_a_collection_inside_the_lock_does_not_hang() -> None:
    """Mappings kept only by reference cycles are released by the collector, which may run while
    this thread holds the module's lock (allocating in :func:`shared_zeros`); the release must
    not wait for that lock."""
    script = textwrap.dedent(
        """
        import gc
        from hicache_storage.hostpool import shared
        gc.set_threshold(50)

        class Holder:
            pass

        for _ in range(3000):
            holder = Holder()
            holder.self = holder
            holder.tensor = shared.shared_zeros(4096, pin=False)
            del holder
        gc.collect()
        with shared._lock:
            shared._forget_dead()
            print(len(shared._mappings))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == 0, "every released mapping was forgotten"
