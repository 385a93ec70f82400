#!/usr/bin/env bash
# Every static gate, for the Python environment this runs in (activate it, or set
# PYTHON): ruff, mypy --strict (mypy.ini), pytype (scripts/pytype_gate.py; Python <= 3.12
# only), pyright and pyrefly on the package and the good usage file, and mypy.stubtest on
# the stubs against what they describe: eqx_offload's, optax's (what mypy reads), and
# pytype's of jax, equinox and jaxtyping (pytype reads no inline types of an installed
# package; held to the newest JAX). All of them run, then exit status 1 if any failed,
# naming them. (tests/test_types.py shows that the pytype gate and the eqx_offload
# stubtest can fail.)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PATH="$("$PY" -c 'import sys, pathlib; print(pathlib.Path(sys.executable).parent)'):$PATH"
failed=()
gate() {
  printf '\n=== %s (%s)\n' "$1" "$(date +%T)"
  "${@:2}" || failed+=("$1")
}

gate "ruff check" ruff check .
gate "mypy --strict" "$PY" -m mypy
if "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 13))'; then
  gate "pytype" "$PY" scripts/pytype_gate.py
else
  echo "=== pytype: skipped (pytype 2024.10.11 runs on Python <= 3.12)"
fi
gate "pyright" pyright eqx_offload tests/types/good_usage.py
gate "pyrefly" pyrefly check eqx_offload tests/types/good_usage.py
gate "stubtest eqx_offload" env MYPYPATH=typings/pytype:typings/mypy "$PY" -m mypy.stubtest \
  eqx_offload --allowlist typings/stubtest-allowlist.txt --mypy-config-file mypy.ini
gate "stubtest optax" env MYPYPATH=typings/mypy "$PY" -m mypy.stubtest optax --ignore-missing-stub \
  --allowlist typings/stubtest-optax-allowlist.txt --mypy-config-file mypy.ini
gate "stubtest jax equinox jaxtyping" env MYPYPATH=typings/pytype "$PY" -m mypy.stubtest jax \
  equinox jaxtyping --ignore-missing-stub --allowlist typings/stubtest-pytype-allowlist.txt --mypy-config-file mypy.ini
if [ ${#failed[@]} -gt 0 ]; then
  printf '\nstatic gates FAILED: %s\n' "$(IFS=,; echo "${failed[*]}")"
  exit 1
fi
echo "all static gates passed"
