#!/usr/bin/env bash
# Every static gate, for the Python environment this runs in (activate it first, or set
# PYTHON): mypy --strict on the package, the pytype gate (skipped, saying so, on Python
# >= 3.13, where pytype does not run), pyright and pyrefly on the package and the good
# usage file with no configuration of their own, the stub-drift check, and the check
# that the docs' checker table matches the tests' markers. Runs them all, then exits 1
# if any failed, naming them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BIN=$("$PY" -c 'import sys, pathlib; print(pathlib.Path(sys.executable).parent)')
export PATH="$BIN:$PATH"

failed=()
gate() {
  local name=$1
  shift
  printf '\n=== %s (%s)\n' "$name" "$(date +%T)"
  if ! "$@"; then
    failed+=("$name")
  fi
}

gate "mypy --strict" "$PY" -m mypy
if "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 13))'; then
  gate "pytype" "$PY" scripts/pytype_gate.py
else
  printf '\n=== pytype: SKIPPED on Python %s (pytype 2024.10.11 runs on Python <= 3.12)\n' \
    "$("$PY" -c 'import platform; print(platform.python_version())')"
fi
gate "pyright" pyright eqx_offload tests/types/good_usage.py
gate "pyrefly" pyrefly check eqx_offload tests/types/good_usage.py
gate "stub drift (typings/pytype/eqx_offload vs the package)" "$PY" scripts/stub_drift.py
gate "checker table (docs/typing-checkers.txt vs tests/types markers)" "$PY" scripts/checker_table.py --check

echo
if [ ${#failed[@]} -gt 0 ]; then
  printf 'static gates FAILED: %s\n' "$(IFS=,; echo "${failed[*]}")"
  exit 1
fi
echo "all static gates passed"
