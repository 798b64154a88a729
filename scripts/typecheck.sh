#!/usr/bin/env bash
# mypy --strict and the import contracts (import-linter, [tool.importlinter] in pyproject.toml) over
# the package exactly as a wheel installs it: backends/, conformance/ and kernels/ only become
# hicache_storage.* inside the wheel, which neither tool can see in the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$stage/dist" .
.venv/bin/python -m zipfile -e "$stage"/dist/hicache_storage-*.whl "$stage/site"
(cd "$stage/site" && "$OLDPWD/.venv/bin/mypy" --config-file "$OLDPWD/pyproject.toml" -p hicache_storage)
# The staged copy comes first on the path, ahead of the editable install's source folders.
(cd "$stage/site" && PYTHONPATH="$stage/site" "$OLDPWD/.venv/bin/lint-imports" --no-cache \
  "$OLDPWD/pyproject.toml")
