"""What publishing one small file costs in a directory: each system call the file backend makes.

The file backend writes a value to a temporary file and links it to its key (``open`` with
``O_CREAT | O_EXCL``, ``write``, ``link``, ``unlink``, ``close``). With pages of a few KiB,
those calls are the write's whole cost, and on some filesystems creating a file costs far more
in one directory than in another (measured on the project's VM: 0.8 ms under ``/tmp``, 12 µs
under ``/root`` of the same ext4 filesystem). Run it on the directory a store would use before
reading a benchmark's write figures; it prints the mean microseconds of each call.

    python scripts/probe_file_create.py DIR [DIR ...] [--files 500] [--bytes 6176]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable


def probe(directory: str, files: int, size: int) -> dict[str, float]:
    """Publish ``files`` files of ``size`` bytes in a fresh directory under ``directory``."""
    root = tempfile.mkdtemp(prefix="probe-file-create-", dir=directory)
    data = os.urandom(size)
    spent = dict.fromkeys(("open", "write", "link", "unlink", "close"), 0.0)

    def timed(name: str, call: Callable[..., object], *args: object) -> object:
        began = time.perf_counter()
        result = call(*args)
        spent[name] += time.perf_counter() - began
        return result

    try:
        for i in range(files):
            path, temp = os.path.join(root, f"k{i}"), os.path.join(root, f".k{i}.tmp")
            fd = timed("open", os.open, temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            assert isinstance(fd, int)
            timed("write", os.write, fd, data)
            timed("link", os.link, temp, path)
            timed("unlink", os.unlink, temp)
            timed("close", os.close, fd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {name: seconds / files * 1e6 for name, seconds in spent.items()}


def main() -> None:
    """Print the mean microseconds of each call, a row a directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", metavar="DIR")
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--bytes", type=int, default=6176, help="a 6 KiB page and its record")
    args = parser.parse_args()
    print(
        f"{'directory':30s}"
        + "".join(f"{name:>10s}" for name in ("open", "write", "link", "unlink", "close"))
    )
    for directory in args.directories:
        row = probe(directory, args.files, args.bytes)
        print(f"{directory:30s}" + "".join(f"{us:9.1f}µ" for us in row.values()))


if __name__ == "__main__":
    main()
