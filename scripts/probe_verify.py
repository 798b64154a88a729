"""Where a verified page read's time goes: the read, the checksum, and verifying chunk by chunk.

Reads 8 MiB pages of one page-cache-warm file into separate buffers on N threads, as the file
backend does, four ways in the same run: the raw read (one ``preadv`` a page), the read then one
CRC32C over the page (what the backend does), and the read in chunks of C bytes, each checksummed
right after it arrives (while it is in the CPU cache), and ``kit.read_checked``, which does the
chunked read and checksum in one native loop without the GIL, at several chunk sizes. Then
hashes the same buffers with every checksum that imports (``crc32c``, ``zlib.crc32``, and
``isal``'s CRC-32 and XXH3 where installed), on 1 and N threads. Prints GB/s and the ratio to
the raw read.

    python scripts/probe_verify.py [--pages 256] [--threads 1,4,8,16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c

from hicache_storage.kit import NATIVE_CHECKED_READS, read_checked

PAGE = 8 << 20
CHUNKS = (128 << 10, 512 << 10, 2 << 20)
NATIVE_CHUNKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _checksums() -> dict[str, Callable[[memoryview], int]]:
    found: dict[str, Callable[[memoryview], int]] = {
        "crc32c": lambda b: int(crc32c.crc32c(b)),
        "zlib.crc32": zlib.crc32,
    }
    try:
        from isal import isal_zlib

        found["isal crc32"] = isal_zlib.crc32
    except ImportError:
        pass
    try:
        import xxhash

        found["xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    return found


def _best_s(pool: ThreadPoolExecutor, work: Callable[[int], object], pages: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        list(pool.map(work, range(pages)))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Run the probe and print one line per thread count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--threads", default="1,4,8,16")
    args = parser.parse_args()
    pages: int = args.pages
    threads = [int(n) for n in args.threads.split(",")]
    bufs = [memoryview(bytearray(PAGE)) for _ in range(pages)]
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "pages")
        block = os.urandom(PAGE)
        with open(path, "wb") as file:
            for _ in range(pages):
                file.write(block)
        fd = os.open(path, os.O_RDONLY)
        try:

            def read(i: int, chunk: int | None = None, check: bool = False) -> None:
                buf = bufs[i]
                if chunk is None:
                    os.preadv(fd, [buf], i * PAGE)
                    if check:
                        crc32c.crc32c(buf)
                    return
                value = 0
                for start in range(0, PAGE, chunk):
                    part = buf[start : start + chunk]
                    os.preadv(fd, [part], i * PAGE + start)
                    value = crc32c.crc32c(part, value=value)

            for n in threads:
                with ThreadPoolExecutor(n) as pool:
                    raw = PAGE * pages / _best_s(pool, read, pages) / 1e9
                    cells = [f"raw {raw:.1f} GB/s"]
                    whole = _best_s(pool, lambda i: read(i, check=True), pages)
                    cells.append(f"read+crc32c {PAGE * pages / whole / 1e9 / raw:.2f}")
                    for chunk in CHUNKS:
                        spent = _best_s(pool, lambda i, c=chunk: read(i, c), pages)  # type: ignore[misc]
                        ratio = PAGE * pages / spent / 1e9 / raw
                        cells.append(f"chunks of {chunk >> 10} KiB {ratio:.2f}")
                    for chunk in NATIVE_CHUNKS if NATIVE_CHECKED_READS else ():
                        spent = _best_s(
                            pool,
                            lambda i, c=chunk: read_checked(  # type: ignore[misc]
                                fd, [bufs[i]], PAGE, i * PAGE, chunk_bytes=c
                            ),
                            pages,
                        )
                        ratio = PAGE * pages / spent / 1e9 / raw
                        cells.append(f"read_checked {chunk >> 10} KiB {ratio:.2f}")
                print(f"{n:2d} threads: " + ", ".join(cells), flush=True)
        finally:
            os.close(fd)
    for n in (1, threads[-1]):
        with ThreadPoolExecutor(n) as pool:
            rates = []
            for name, fn in _checksums().items():
                spent = _best_s(pool, lambda i, f=fn: f(bufs[i]), pages)  # type: ignore[misc]
                rates.append(f"{name} {PAGE * pages / spent / 1e9:.1f}")
        print(f"{n:2d} threads, checksum GB/s: " + ", ".join(rates), flush=True)


if __name__ == "__main__":
    main()
