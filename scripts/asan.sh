#!/usr/bin/env bash
# Build the native checked-I/O helper (hicache_storage/kit/_checkedio.c) with AddressSanitizer
# into a temporary directory and run its tests against that build: a use-after-free, an
# overflow or a double free in the helper fails the run (CI calls this from scripts/test.sh).
#
# The interpreter is not built with ASan, so the runtime is preloaded; Python's own allocator is
# switched to malloc (PYTHONMALLOC=malloc) so that a Python object the helper uses after it was
# freed (a path string of a list changed while the helper's threads run) is caught too. Leak
# checks are off: the interpreter keeps its memory at exit by design.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "asan.sh: the helper is built for x86-64 only; nothing to check on $(uname -m)"
  exit 0
fi
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
INCLUDE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
SO="$BUILD/_checkedio$SUFFIX"
gcc -shared -fPIC -O1 -g -pthread -fsanitize=address -fno-omit-frame-pointer -Wall -Werror \
  -I"$INCLUDE" hicache_storage/kit/_checkedio.c -o "$SO"
LIBASAN="$(gcc -print-file-name=libasan.so)"
if [[ ! -f "$LIBASAN" ]]; then
  echo "asan.sh: gcc has no AddressSanitizer runtime (libasan.so); install gcc's libasan" >&2
  exit 1
fi
# The tests import the helper as hicache_storage.kit._checkedio: the ASan build is put in its
# place before anything imports it, and the run fails if another one was loaded.
LD_PRELOAD="$LIBASAN" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONMALLOC=malloc \
  "$PY" - "$SO" <<'EOF'
import importlib.util
import sys

import pytest

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("hicache_storage.kit._checkedio", path)
assert spec is not None and spec.loader is not None
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules[spec.name] = module  # hicache_storage itself is not imported yet (pytest does)

code = pytest.main(
    [
        "tests/test_checked_reads.py",
        "tests/test_checkedio_native.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-o",
        "addopts=-ra",
    ]
)
assert sys.modules["hicache_storage.kit.pageio"]._CHECKED is module, "ran another build"
sys.exit(code)
EOF
