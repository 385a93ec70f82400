#!/usr/bin/env bash
# The README's test command: every test and gate, in the two environments at the ends of
# the supported range, or the fast tier of the edit-test loop.
#
#   bash scripts/check.sh           # both environments (what .ci/run runs)
#   bash scripts/check.sh oldest    # one of them (or: newest)
#   bash scripts/check.sh fast      # the library's quick tests, oldest environment only
#   bash scripts/check.sh accelerator  # tests/accelerator, on a machine with a TPU or GPU
#
#   oldest  .venv      Python 3.11, jax == jaxlib == 0.10.2 (.ci/constraints-oldest.txt),
#                      and libtpu (the TPU compiler: tests/tpu compile for a v5e without one)
#   newest  .venv-new  Python 3.12, the newest jax and jaxlib; the GPU compiler (plan) and
#                      libtpu where released for it (else their tests skip, saying so)
#
# Each environment: a venv (created if missing), uv in it (with pip), the package with
# its dev extra (uv pip install, every run but `fast`), then pytest. The oldest runs the
# library's tests (-m "not once") from the end of its install, alongside all of the
# newest's stages: its pytest of the tests marked `once` or `both` (every test with
# CHECK_FULL=1), the static gates (scripts/gates.sh) and `mkdocs build --strict`. Then a
# table of the stages, with the wall and the CPU seconds (user + system) of each, and the
# line `check: N passed, M failed, K skipped` over every pytest run; exit status 1 if
# any stage failed (a pytest that collects nothing exits 5: failed).
# Interpreters: $PYTHON_OLDEST / $PYTHON_NEWEST, else python3.11 / python3.12 on PATH,
# else pyenv's versions.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
if [ "${1:-}" = accelerator ]; then  # the Python and packages already there, JAX's backend
  exec "${PYTHON:-python3}" -m pytest --confcutdir=tests/accelerator -p no:xdist -q \
    -W "ignore:Transparent hugepages" tests/accelerator "${@:2}"
fi
export JAX_PLATFORMS=cpu  # also where the GPU compiler (gpu_plan) is installed
# Each module's bytecode is written by the first process that imports it, read by the
# rest (the install ends with one import of what most test processes load).
unset PYTHONDONTWRITEBYTECODE
MODE=${1:-both}
case $MODE in both | oldest | newest | fast) ;; *) echo "usage: $0 [oldest|newest|fast|accelerator]" >&2; exit 2 ;; esac

find_python() {  # VERSION [PATH]: the first candidate that really is Python VERSION
  local p
  for p in ${2:-$(command -v "python$1") $(pyenv root 2>/dev/null)/versions/$1.*/bin/python \
      $HOME/.pyenv/versions/$1*/bin/python}; do
    if [ "$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$1" ]; then
      echo "$p"
      return
    fi
  done
  echo "check.sh: no Python $1 (python$1 on PATH, pyenv's versions): install it or set $3" >&2
  return 1
}

# stage NAME CMD...: CMD (with `set -e`), its output kept and printed when it ends; its
# name, status, wall and CPU seconds (bash's `times` in a subshell of its own) recorded.
stage() {
  local name=$1 log="$LOGS/${1//[^A-Za-z0-9]/_}.log" start=$SECONDS rc status=ok cpu
  shift
  echo "=== $name: started $(date +%T)"
  if [ "$MODE" = fast ]; then  # alone: its output as it comes
    ( (set -e; "$@"); rc=$?; times > "$log.times"; exit $rc ) 2>&1 | tee "$log"
  else
    ( (set -e; "$@"); rc=$?; times > "$log.times"; exit $rc ) > "$log" 2>&1
  fi
  rc=$?
  [ $rc = 0 ] || status=FAILED
  cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, "m"); s += t[1] * 60 + t[2] } }
             END { printf "%d", s }' "$log.times")
  printf '%s\t%s\t%d\t%d\n' "$name" "$status" $((SECONDS - start)) "$cpu" >> "$LOGS/stages"
  printf '\n=== %s: %s (%d s)\n' "$name" "$status" $((SECONDS - start))
  [ "$MODE" = fast ] || cat "$log"
  return $rc
}

jax_version() { "$1" -c 'import importlib.metadata as m; print(m.version("jax"), m.version("jaxlib"))'; }

pip_has() { "$1" -m pip show -q "$2" 2> /dev/null && echo yes; }  # PYTHON PACKAGE

# compiler PYTHON REQUIREMENT EXTRA STALE...: install REQUIREMENT (and EXTRA) if it is
# released, else remove the STALE packages a previous JAX left (a compiler must match
# its JAX) and say so; the tests that need it skip, naming the version.
compiler() {
  local py=$1 requirement=$2 extra=$3
  shift 3
  if "$py" -m uv pip install -q --dry-run --python "$py" "$requirement" > /dev/null 2>&1; then
    "$py" -m uv pip install -q --python "$py" "$requirement" ${extra:+"$extra"}
  else
    echo "$requirement: not released; its tests skip"
    "$py" -m uv pip uninstall -q --python "$py" "$@" 2> /dev/null || true
  fi
}

install() {  # ENV DIR PYTHON: DIR a venv of PYTHON's version, the package installed in it
  local py=$ROOT/$2/bin/python want
  if [ "$("$py" -V 2>&1)" != "$("$3" -V 2>&1)" ]; then rm -rf "$2"; "$3" -m venv "$2"; fi
  "$py" -m pip install -q uv
  uvpip() { "$py" -m uv pip install -q --python "$py" "$@"; }
  if [ "$1" = oldest ]; then  # (libtpu: the TPU compiler, for tests/tpu without a chip)
    uvpip -e ".[dev]" "jax[tpu]==0.10.2" -c .ci/constraints-oldest.txt
    want="0.10.2 0.10.2"
  else  # the newest JAX, then its compilers where released (a JAX release can come days
    # before its jax-cuda12-plugin or libtpu: the GPU-plan and TPU-plan tests then skip,
    # naming the missing version); the package and the compilers leave JAX as it is
    want=$("$py" -m pip index versions jax 2> /dev/null | sed -n 's/^jax (\(.*\))$/\1/p')
    [ -n "$want" ] || { echo "no release of jax found"; exit 1; }
    uvpip "jax==$want" "jaxlib==$want"
    want=$(jax_version "$py")
    uvpip -e ".[dev]"
    compiler "$py" "jax-cuda12-plugin==${want%% *}" nvidia-cuda-nvcc-cu12 jax-cuda12-plugin jax-cuda12-pjrt
    [ -z "$(pip_has "$py" jax-cuda12-plugin)" ] \
      || "$py" -c 'from eqx_offload._plan import deviceless; deviceless.check_available()'
    compiler "$py" "jax[tpu]==${want%% *}" "" libtpu
  fi
  [ -z "$(pip_has "$py" libtpu)" ] \
    || "$py" -c 'from eqx_offload._plan import tpu; tpu.check_available()'  # libtpu
  [ "$(jax_version "$py")" = "$want" ] || { echo "expected jax, jaxlib $want"; exit 1; }
  echo "$1: $("$py" -V), jax/jaxlib $want"
  "$py" -c 'import eqx_offload, eqx_offload.cli, jax, equinox, optax, flax.nnx, orbax.checkpoint, optimistix, hypothesis, pytest, xdist'
}

in_env() {  # DIR CMD...: CMD with DIR's venv activated
  local dir=$ROOT/$1
  shift
  VIRTUAL_ENV=$dir PATH=$dir/bin:$PATH "$@"
}

docs() { local site; site=$(mktemp -d); NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"; }

# (No stage in a command that `&&` or `||` tests: bash would ignore its `set -e`.)
oldest() {
  stage "oldest: venv and install" install oldest .venv "$PY_OLDEST"
  [ $? = 0 ] || return
  stage "oldest: pytest -m 'not once' (3 workers)" in_env .venv python -m pytest -q -n 3 -m "not once"
}

newest() {
  local select=(-m "once or both")
  [ "${CHECK_FULL:-}" != 1 ] || select=()
  stage "newest: venv and install" install newest .venv-new "$PY_NEWEST"
  [ $? = 0 ] || return
  { stage "newest: static gates" in_env .venv-new bash scripts/gates.sh
    stage "newest: mkdocs build --strict" in_env .venv-new docs; } &
  local side=$!
  stage "newest: pytest ${select[*]:-(all)} (2 workers)" in_env .venv-new python -m pytest -q -n 2 "${select[@]}"
  wait $side
}

# The fast tier: the library's tests without the slow and once ones, and without the
# heaviest files, on 2 workers, in .venv as it is (installed if missing). Left out (they
# run in `oldest`): the ported programs (test_programs, test_ports), the streamed update's
# (test_stream), the LLVM-level canary, and the XLA:TPU compiles through libtpu (tests/tpu,
# the v5e plans and the start-up plan: half the rest's CPU time, --durations=0) and the
# resident-memory measurements (test_host_bytes). The bitwise matrix (test_equivalence)
# marks its heavy cases slow, as the saving and soak checks (test_checkpoint) do; its
# common optimizers and hypothesis tests stay.
FAST_IGNORE=(jit/test_programs.py optim/test_ports.py stream/test_stream.py
             upstream/test_upstream_llvm_level.py tpu plan/test_tpu_plan.py
             plan/test_startup_plan.py models/test_host_bytes.py)
fast() {
  if ! in_env .venv python -c 'import eqx_offload, xdist' 2>/dev/null; then
    stage "oldest: venv and install" install oldest .venv "$PY_OLDEST"
    [ $? = 0 ] || return
  fi
  stage "fast: pytest -m 'not slow and not once' (2 workers)" in_env .venv python -m pytest -q -n 2 \
    -m "not slow and not once" "${FAST_IGNORE[@]/#/--ignore=tests/}"
}

[ "$MODE" = newest ] || PY_OLDEST=$(find_python 3.11 "${PYTHON_OLDEST:-}" PYTHON_OLDEST) || exit 1
[ "$MODE" = oldest ] || [ "$MODE" = fast ] || PY_NEWEST=$(find_python 3.12 "${PYTHON_NEWEST:-}" PYTHON_NEWEST) || exit 1
case $MODE in
  both) oldest & newest; wait ;;
  *) "$MODE" ;;
esac

echo
echo "=== time per stage (stages run side by side; CPU: user + system seconds, $(nproc) cores)"
printf '  %-60s %-6s %6s %6s\n' stage "" wall CPU
awk -F '\t' '{ printf "  %-60s %-6s %4d s %4d s\n", $1, $2, $3, $4 }' "$LOGS/stages"
times > "$LOGS/total.times"
awk -v wall=$SECONDS 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, "m"); s += t[1] * 60 + t[2] } }
    END { printf "  %-60s %-6s %4d s %4d s\n", "total", "", wall, s }' "$LOGS/total.times"
cat "$LOGS"/*pytest*.log 2>/dev/null | grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s' \
  | grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' \
  | awk '{ n[$2 ~ /^err/ ? "failed" : $2] += $1 }
         END { printf "check: %d passed, %d failed, %d skipped\n", n["passed"], n["failed"], n["skipped"] }'
! grep -q FAILED "$LOGS/stages" && [ -s "$LOGS/stages" ]
