#!/usr/bin/env bash
# Build the documentation site (docs/ -> docs/_build/html) strictly: every warning is an error and
# every cross-reference must resolve (-n). Installs the docs extra into .venv when it is missing.
# -E rereads every page, so a warning in a page that did not change still fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import sphinx, furo, myst_parser" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[docs]"
fi
.venv/bin/python -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html "$@"
