#!/usr/bin/env bash
# Installs eqx_offload with its dev extra into ./.venv and runs every test and gate:
# pytest (with jaxtyping+beartype runtime checks), mypy --strict, pytype over the
# package with the stubs in typings/, the stub-drift check and the docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[dev]"

stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

stage "pytest"
python -m pytest -n 2 -q

stage "mypy --strict"
python -m mypy

stage "pytype"
python scripts/pytype_gate.py

stage "stub drift (typings/eqx_offload vs the package)"
python scripts/stub_drift.py

stage "mkdocs build --strict"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$(mktemp -d)"

echo
echo "all tests and gates passed"
