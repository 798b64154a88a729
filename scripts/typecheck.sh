#!/usr/bin/env bash
# mypy --strict and the import contracts (import-linter, [tool.importlinter] in pyproject.toml) over
# the source tree. backends/, conformance/ and kernels/ are hicache_storage.* subpackages
# ([tool.setuptools.package-dir]); neither tool reads that mapping, so build/typecheck/ holds a
# package of symbolic links to the source folders, laid out as the package imports, and both
# tools read the sources through it (nothing is built or copied). Paths in mypy's messages are
# given back as the source tree's.
set -euo pipefail
cd "$(dirname "$0")/.."
view=build/typecheck
rm -rf "$view"
mkdir -p "$view/hicache_storage"
for entry in hicache_storage/*; do
  [ "$(basename "$entry")" = __pycache__ ] || ln -s "$PWD/$entry" "$view/hicache_storage/"
done
for wing in backends conformance kernels; do
  ln -s "$PWD/$wing" "$view/hicache_storage/$wing"
done
status=0
(cd "$view" && "$OLDPWD/.venv/bin/mypy" --config-file "$OLDPWD/pyproject.toml" \
  --cache-dir "$OLDPWD/.mypy_cache" -p hicache_storage) \
  | sed -E 's#^hicache_storage/(backends|conformance|kernels)/#\1/#' || status=$?
# The view comes first on the path, ahead of the editable install's import hook.
(cd "$view" && PYTHONPATH="$PWD" "$OLDPWD/.venv/bin/lint-imports" --no-cache \
  "$OLDPWD/pyproject.toml") || status=$?
exit "$status"
