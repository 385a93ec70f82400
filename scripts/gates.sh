#!/usr/bin/env bash
# Every static gate, each through its tool's own runner where that works, for the Python
# environment this runs in (activate it first, or set PYTHON): ruff (pyproject.toml's
# [tool.ruff]), mypy --strict (mypy.ini), pytype (scripts/pytype_gate.py, which says why
# not the `pytype` command; skipped, saying so, on Python >= 3.13, where pytype does not
# run), pyright and pyrefly on the package and the good usage file, and mypy.stubtest
# (the shipped stub of eqx_offload against the package). None of them depends on the JAX
# version: scripts/check.sh runs them in the newest environment. Runs them all, then
# exits 1 if any failed, naming them. (That each can fail is tested in
# tests/test_types.py: the tests/types/bad_*.py files are rejected with the expected
# codes, pytype rejects a module with a type error, stubtest a changed signature.)
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

gate "ruff check" ruff check .
gate "mypy --strict" "$PY" -m mypy
if "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 13))'; then
  gate "pytype" "$PY" scripts/pytype_gate.py
else
  printf '\n=== pytype: SKIPPED on Python %s (pytype 2024.10.11 runs on Python <= 3.12)\n' \
    "$("$PY" -c 'import platform; print(platform.python_version())')"
fi
gate "pyright" pyright eqx_offload tests/types/good_usage.py
gate "pyrefly" pyrefly check eqx_offload tests/types/good_usage.py
# The stub pytype users read (typings/pytype/eqx_offload/) against the package, with
# the optax stub it refers to; typings/stubtest-allowlist.txt says what is not drift.
gate "stubtest (typings/pytype/eqx_offload vs the package)" \
  env MYPYPATH=typings/pytype:typings/mypy "$PY" -m mypy.stubtest eqx_offload \
  --allowlist typings/stubtest-allowlist.txt --mypy-config-file mypy.ini

echo
if [ ${#failed[@]} -gt 0 ]; then
  printf 'static gates FAILED: %s\n' "$(IFS=,; echo "${failed[*]}")"
  exit 1
fi
echo "all static gates passed"
