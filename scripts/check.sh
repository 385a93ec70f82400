#!/usr/bin/env bash
# Installs eqx_offload with its dev extra into ./.venv and runs every test and gate:
# pytest (with jaxtyping+beartype runtime checks), the static gates (scripts/gates.sh:
# mypy --strict, pytype with the shipped stubs, pyright, pyrefly, stub drift, the docs'
# checker table) and the docs build.
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

stage "static gates: mypy, pytype, pyright, pyrefly, stub drift, checker table"
bash scripts/gates.sh

stage "mkdocs build --strict"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$(mktemp -d)"

echo
echo "all tests and gates passed"
