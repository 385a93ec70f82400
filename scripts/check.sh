#!/usr/bin/env bash
# Every test and gate, in the two environments the package supports at its ends:
#
#   oldest  .venv      Python 3.11, jax == jaxlib == 0.10.2 (.ci/constraints-oldest.txt)
#   newest  .venv-new  Python 3.12, the newest jax and jaxlib pip resolves
#
# In each: install eqx_offload with its dev extra (venvs are created if missing, deps
# installed every run with uv, which makes that fast) and pytest (with the
# jaxtyping+beartype runtime checks). What does not depend on the JAX version (tests
# marked `once`: static checkers, docs, wheel, command line, GPU-plan scripts) runs in
# the newest environment only, and so do the static gates (`scripts/gates.sh`: ruff,
# mypy --strict, pytype, pyright, pyrefly, stubtest) and `mkdocs build --strict`; the
# oldest runs the library's tests (`-m "not once"`), the newest those of them marked
# `both` (the canaries of tests/upstream/ and the claims that differ between JAX
# versions), or all of them with CHECK_FULL=1 (before a release, or after a change to
# a JAX-version-dependent path). The newest environment's install runs alongside the
# oldest's, and the oldest pytest (3 xdist workers, the newest's 2) in the background
# (its output printed when it ends), alongside the newest environment's pytest and gates.
# A per-stage time summary and the closing line `check: N passed, M failed, K skipped`
# (every test of every environment that ran) end the output, failed or not.
#
#   bash scripts/check.sh                  # both environments (what .ci/run runs)
#   bash scripts/check.sh newest           # one environment: oldest or newest
#   bash scripts/check.sh --pythons        # print the interpreters it would use, and stop
#
# Interpreters: $PYTHON_OLDEST / $PYTHON_NEWEST if set; else `python3.11` / `python3.12`
# on PATH; else $(pyenv root)/versions/3.1x.*/bin/python; else
# ~/.pyenv/versions/3.1x*/bin/python. A missing one fails the run, naming what it tried.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU backend for every test, also where jax-cuda12-plugin (gpu_plan) is installed.
export JAX_PLATFORMS=cpu
# Python writes each module's bytecode when a process first imports it, and every later
# process of the run reads it (where PYTHONDONTWRITEBYTECODE is set, as on these
# machines, each of the run's many Python processes compiled jax, flax, optax... from
# source: 5.0 vs 2.1 CPU-s for their imports). Instead of compiling every installed
# file at install time (uv's --compile-bytecode: 21 CPU-s per environment, most of it
# for modules no test imports), only what is imported is compiled; see install().
unset PYTHONDONTWRITEBYTECODE
ROOT=$PWD
# xdist workers of the oldest environment's pytest, the longest stage (it runs in the
# background, alongside the newest environment's stages; see bg_start); the newest's
# pytest has 2. With the other core busy the scheduler shares the cores out per
# runnable process, so a third worker gets the run more of the machine where it lags
# most; on a quiet machine it changes little. Measured from clean clones (this machine,
# `CI=true bash .ci/run`): other core busy 1064 s (2 workers: 1167, 1266 s); quiet
# 904 s (2 workers: 910, 950, 1029 s). On a faster machine of this kind, other core
# busy: 868 s with 3 workers, 920 s with 4 (a fourth is not kept).
OLDEST_WORKERS=${CHECK_OLDEST_WORKERS:-3}

# ------------------------------------------------------------------ stages and timing
STAGE_NAMES=()
STAGE_SECONDS=()
STAGE_CPU=()
STAGE_STATUS=()
CURRENT=""
CURRENT_START=0
MEASURED_CPU=0
RUN_START=$SECONDS
PASSED=0
FAILED=0
SKIPPED=0

# child_cpu: CHILD_CPU, the CPU seconds (user + system) of the processes this shell has
# started and waited for so far, their own children included (bash's `times`, second
# line: `1m2.500s 0m3.250s`). Run in the shell whose children count (not in `$(...)`:
# a subshell counts only its own). Each stage runs in a subshell of its own and counts
# there (`measured`, or the background stages' subshells): the main shell's count also
# takes in a background stage whenever bash reaps it. The stage table shows it beside
# the wall time: with stages side by side, wall seconds say when a stage ended, CPU
# seconds what it cost. A file per shell ($BASHPID): the background stages count at the
# same time.
TIMES_DIR=$(mktemp -d)
child_cpu() {
  local file="$TIMES_DIR/$BASHPID"
  times > "$file"
  CHILD_CPU=$(awk 'NR == 2 {
    s = 0
    for (i = 1; i <= 2; i++) { v = $i; sub(/s$/, "", v); split(v, p, "m"); s += p[1] * 60 + p[2] }
    printf "%d\n", s
  }' "$file")
  rm -f "$file"
}

# measured CMD...: CMD (with `set -e`) in a subshell; MEASURED_CPU is the CPU seconds it
# used, and its exit status CMD's. (Not `( ... ) || rc=$?`: bash ignores `set -e` in all
# of a command that `||` tests, a subshell's own `set -e` included.)
measured() {
  local file rc errexit=""
  case $- in *e*) errexit=1 ;; esac
  file=$(mktemp)
  set +e
  (
    (set -e; "$@")
    status=$?
    child_cpu
    echo "$CHILD_CPU" > "$file"
    exit "$status"
  )
  rc=$?
  [ -z "$errexit" ] || set -e
  MEASURED_CPU=$(cat "$file" 2>/dev/null || echo 0)
  rm -f "$file"
  return "$rc"
}

begin() {
  CURRENT=$1
  CURRENT_START=$SECONDS
  MEASURED_CPU=0
  printf '\n=== %s (%s)\n' "$CURRENT" "$(date +%T)"
}

end() {
  STAGE_NAMES+=("$CURRENT")
  STAGE_SECONDS+=($((SECONDS - CURRENT_START)))
  STAGE_CPU+=("$MEASURED_CPU")
  STAGE_STATUS+=("${1:-ok}")
  CURRENT=""
}

summary() {
  local rc=$?
  if [ -n "${SIDE_PID:-}" ]; then
    wait "$SIDE_PID" 2>/dev/null || true
  fi
  if [ -n "${INSTALL_PID:-}" ]; then
    wait "$INSTALL_PID" 2>/dev/null || true
  fi
  if [ -n "${BG_PID:-}" ]; then
    # A stage failed while the oldest pytest ran: that pytest's output still comes.
    bg_collect || [ "$rc" -ne 0 ] || rc=1
  fi
  if [ -n "$CURRENT" ]; then
    end FAILED
  fi
  if [ -n "${BUILTINS_DIR:-}" ]; then
    rm -rf "$BUILTINS_DIR"
  fi
  child_cpu
  rm -rf "$TIMES_DIR"
  printf '\n=== time per stage (one "in the background" overlaps the stages after it;\n'
  printf '    CPU: user + system seconds of its processes, on %s cores)\n' "$(nproc 2>/dev/null || echo '?')"
  printf '  %-64s %6s  %7s  %7s\n' "stage" "" "wall" "CPU"
  local i
  for i in "${!STAGE_NAMES[@]}"; do
    printf '  %-64s %6s  %5d s  %5d s\n' "${STAGE_NAMES[$i]}" "${STAGE_STATUS[$i]}" \
      "${STAGE_SECONDS[$i]}" "${STAGE_CPU[$i]:-0}"
  done
  printf '  %-64s %6s  %5d s  %5d s\n' "total" "" $((SECONDS - RUN_START)) "$CHILD_CPU"
  echo
  if [ "$rc" -eq 0 ]; then
    echo "all tests and gates passed"
  else
    echo "check FAILED (exit status $rc)"
  fi
  # The closing line: the tests of every environment that ran, added up. A skip is
  # counted, not failed: in CI nothing should skip (the GPU-plan tests need the GPU
  # compiler, which the newest environment's install checks), and the count shows it.
  echo "check: $PASSED passed, $FAILED failed, $SKIPPED skipped"
  exit "$rc"
}
trap summary EXIT

fail() {
  echo "check.sh: $*" >&2
  exit 1
}

# ------------------------------------------------------------------ interpreters
# find_python 3.12: the first interpreter that really is Python 3.12 (a pyenv shim on
# PATH may exist without the version behind it).
find_python() {
  local want=$1 override=$2 candidate
  local -a candidates=()
  if [ -n "$override" ]; then
    candidates=("$override")
  else
    candidates+=("$(command -v "python$want" || true)")
    if command -v pyenv >/dev/null 2>&1; then
      candidates+=("$(pyenv root)"/versions/"$want".*/bin/python)
    fi
    candidates+=("$HOME"/.pyenv/versions/"$want"*/bin/python)
  fi
  for candidate in "${candidates[@]}"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
        && [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]; then
      echo "$candidate"
      return 0
    fi
  done
  echo "check.sh: Python $want not found (tried: ${override:-python$want on PATH, \$(pyenv root)/versions/$want.*/bin/python, ~/.pyenv/versions/$want*/bin/python}); install it (e.g. pyenv install $want) or set PYTHON_$3 to its path" >&2
  return 1
}

PY_OLDEST=$(find_python 3.11 "${PYTHON_OLDEST:-}" OLDEST) || exit 1
PY_NEWEST=$(find_python 3.12 "${PYTHON_NEWEST:-}" NEWEST) || exit 1

ENVS=("$@")
if [ "${ENVS[*]:-}" = "--pythons" ]; then
  trap - EXIT
  echo "oldest: $PY_OLDEST"
  echo "newest: $PY_NEWEST"
  exit 0
fi
if [ ${#ENVS[@]} -eq 0 ]; then
  ENVS=(oldest newest)
fi
for env in "${ENVS[@]}"; do
  case "$env" in
    oldest | newest) ;;
    *) fail "unknown environment '$env' (oldest, newest, or --pythons)" ;;
  esac
done

# ------------------------------------------------------------------ one environment
jax_version() {
  "$1" -c 'import importlib.metadata as m; print(m.version("jax"), m.version("jaxlib"))'
}

# make_venv DIR PYTHON: DIR is a venv of PYTHON's version (recreated if not).
make_venv() {
  local dir=$1 python=$2 want have
  want=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -x "$dir/bin/python" ]; then
    have=$("$dir/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
    if [ "$have" != "$want" ]; then
      echo "$dir is Python ${have:-?}, not $want: recreating it"
      rm -rf "$dir"
    fi
  fi
  if [ ! -x "$dir/bin/python" ]; then
    "$python" -m venv "$dir"
  fi
}

# install ENV PY: the package with its dev extra, JAX per ENV. uv (installed into the
# venv with pip) does the installing: it resolves as pip does, downloads in parallel,
# and checks an up-to-date venv in a second (pip: about a minute per environment).
install() {
  local env=$1 py=$2 before after
  "$py" -m pip install --quiet uv
  # No --compile-bytecode (see PYTHONDONTWRITEBYTECODE above): the imports at the end
  # write the bytecode of what the tests import, once, before the test processes start.
  uvpip() { "$py" -m uv pip "$@" --python "$py" --quiet; }
  if [ "$env" = oldest ]; then
    uvpip install -e ".[dev]" -c .ci/constraints-oldest.txt
    [ "$(jax_version "$py")" = "0.10.2 0.10.2" ] \
      || fail "oldest: expected jax and jaxlib 0.10.2, got $(jax_version "$py")"
  else
    # The newest JAX first; then installing the package must leave it as it is.
    uvpip install --upgrade jax jaxlib
    before=$(jax_version "$py")
    uvpip install -e ".[dev]"
    after=$(jax_version "$py")
    [ "$before" = "$after" ] \
      || fail "newest: installing eqx_offload changed jax/jaxlib from $before to $after"
    # The GPU compiler for gpu_plan (the `plan` extra), at exactly this JAX's version;
    # its tests skip without it, so its absence fails the run here instead.
    uvpip install "jax-cuda12-plugin==${after%% *}" nvidia-cuda-nvcc-cu12
    JAX_PLATFORMS=cpu "$py" -c 'from eqx_offload import _deviceless; _deviceless.check_available()' \
      || fail "newest: the GPU compiler for gpu_plan is not usable"
  fi
  # What most test processes import, compiled to bytecode once here (else the first
  # xdist workers, starting together, would each compile it).
  JAX_PLATFORMS=cpu "$py" -c 'import eqx_offload, eqx_offload.cli, jax, equinox, optax, flax.nnx, orbax.checkpoint, optimistix, hypothesis, pytest, xdist'
}

# pytest_logged LOG WORKERS [ARGS]: pytest's output to the terminal and to LOG; pytest's
# exit status (pipefail).
pytest_logged() {
  local log=$1 workers=$2
  shift 2
  python -m pytest -n "$workers" -q "$@" 2>&1 | tee "$log"
}

# run_pytest ENV WORKERS [ARGS]: the suite (narrowed by ARGS) in WORKERS xdist workers; a
# run that collects no test fails.
run_pytest() {
  local env=$1 workers=$2 log rc=0 passed failed skipped
  shift 2
  log=$(mktemp)
  measured pytest_logged "$log" "$workers" "$@" || rc=$?
  # pytest's closing line, e.g. "2 failed, 480 passed, 1 error in 300.00s (0:05:00)".
  passed=$(tail -n 5 "$log" | { grep -Eo '[0-9]+ passed' || true; } | awk '{n = $1} END {print n + 0}')
  failed=$(tail -n 5 "$log" | { grep -Eo '[0-9]+ (failed|errors?)' || true; } | awk '{s += $1} END {print s + 0}')
  skipped=$(tail -n 5 "$log" | { grep -Eo '[0-9]+ skipped' || true; } | awk '{n = $1} END {print n + 0}')
  rm -f "$log"
  PASSED=$((PASSED + passed))
  FAILED=$((FAILED + failed))
  SKIPPED=$((SKIPPED + skipped))
  if [ "$rc" -eq 5 ] || [ "$passed" -eq 0 ]; then
    echo "check.sh: $env: pytest ran no test (exit status $rc)" >&2
    return 1
  fi
  if [ "$rc" -ne 0 ]; then
    echo "check.sh: $env: pytest failed (exit status $rc)" >&2
    return 1
  fi
}

# bg_start LABEL ENV WORKERS [ARGS]: run_pytest ENV WORKERS [ARGS] in the background, its output to a
# file; bg_collect waits for it, prints that output, records the stage and adds its
# counts (the summary calls it after a failure); bg_wait also fails the run if it
# failed. The oldest environment's pytest runs so, alongside the newest environment's
# install, pytest and gates. On a quiet machine that changes little (the cores are busy
# either way); with the other core busy, the run's many runnable processes get a larger
# share of the machine (measured from clean clones, 2 workers: 1295 s in sequence,
# 1167-1266 s so).
BG_PID=""
bg_start() {
  BG_STAGE="$2: $1 (in the background)"
  BG_ENV=$2
  shift
  BG_LOG=$(mktemp)
  BG_RESULT=$(mktemp)
  BG_START=$SECONDS
  printf '\n=== %s (%s): its output follows when it ends\n' "$BG_STAGE" "$(date +%T)"
  (
    PASSED=0 FAILED=0 SKIPPED=0 rc=0
    run_pytest "$@" || rc=1
    echo "$PASSED $FAILED $SKIPPED $rc $((SECONDS - BG_START)) $MEASURED_CPU" > "$BG_RESULT"
  ) > "$BG_LOG" 2>&1 &
  BG_PID=$!
}

bg_wait() {
  bg_collect || fail "$BG_ENV: pytest failed"
}

bg_collect() {
  local passed failed skipped rc seconds cpu
  [ -n "$BG_PID" ] || return 0
  wait "$BG_PID" || true
  BG_PID=""
  printf '\n=== %s: output\n' "$BG_STAGE"
  cat "$BG_LOG"
  read -r passed failed skipped rc seconds cpu < "$BG_RESULT" \
    || { passed=0 failed=0 skipped=0 rc=1 seconds=$((SECONDS - BG_START)) cpu=0; }
  rm -f "$BG_LOG" "$BG_RESULT"
  PASSED=$((PASSED + passed))
  FAILED=$((FAILED + failed))
  SKIPPED=$((SKIPPED + skipped))
  STAGE_NAMES+=("$BG_STAGE")
  STAGE_SECONDS+=("$seconds")
  STAGE_CPU+=("$cpu")
  if [ "$rc" = 0 ]; then STAGE_STATUS+=(ok); else STAGE_STATUS+=(FAILED); fi
  [ "$rc" = 0 ]
}

# side_start: the static gates, then the strict docs build, in the background (output
# to a file); side_wait prints that output and records both as stages. They run
# alongside the newest environment's pytest: each is mostly one process on one core
# (pytype's modules wait on each other), so together they fill the cores that pytest's
# workers leave idle at the end of their queues.
SIDE_PID=""
side_start() {
  SIDE_LOG=$(mktemp)
  SIDE_TIMES=$(mktemp)
  (
    start=$SECONDS
    gates=ok
    bash scripts/gates.sh || gates=FAILED
    middle=$SECONDS
    child_cpu
    gates_cpu=$CHILD_CPU
    docs=ok
    site=$(mktemp -d)
    printf '\n=== mkdocs build --strict (%s)\n' "$(date +%T)"
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site" || docs=FAILED
    rm -rf "$site"
    child_cpu
    echo "$gates $((middle - start)) $docs $((SECONDS - middle)) $gates_cpu" \
      "$((CHILD_CPU - gates_cpu))" > "$SIDE_TIMES"
  ) > "$SIDE_LOG" 2>&1 &
  SIDE_PID=$!
}

side_wait() {
  local gates gates_s docs docs_s gates_cpu docs_cpu
  wait "$SIDE_PID" || true
  SIDE_PID=""
  printf '\n=== %s: static gates and mkdocs build --strict (run alongside pytest)\n' "$1"
  cat "$SIDE_LOG"
  read -r gates gates_s docs docs_s gates_cpu docs_cpu < "$SIDE_TIMES" \
    || { gates=FAILED docs=FAILED gates_s=0 docs_s=0 gates_cpu=0 docs_cpu=0; }
  rm -f "$SIDE_LOG" "$SIDE_TIMES"
  STAGE_NAMES+=("$1: static gates (alongside pytest)" "$1: mkdocs build --strict (alongside)")
  STAGE_SECONDS+=("$gates_s" "$docs_s")
  STAGE_CPU+=("$gates_cpu" "$docs_cpu")
  STAGE_STATUS+=("$gates" "$docs")
  [ "$gates" = ok ] || fail "$1: static gates failed"
  [ "$docs" = ok ] || fail "$1: mkdocs build --strict failed"
}

# install_stage ENV DIR PYTHON: ENV's venv in DIR (of PYTHON's version) and its install.
install_stage() {
  make_venv "$2" "$3"
  install "$1" "$ROOT/$2/bin/python"
  echo "$1: $("$2/bin/python" --version 2>&1), jax/jaxlib $(jax_version "$2/bin/python")"
}

# install_start ENV DIR PYTHON: install_stage in the background, its output to a file;
# install_wait prints that output and records the stage (failing the run if it failed).
# With both environments the newest's install starts so at the start, alongside the
# oldest's: both are mostly downloads and unpacking, a core each at most.
INSTALL_PID=""
install_start() {
  INSTALL_STAGE="$1: venv and install ($2, $("$3" --version 2>&1), alongside)"
  INSTALL_LOG=$(mktemp)
  INSTALL_RESULT=$(mktemp)
  INSTALL_START=$SECONDS
  (
    # (`measured`, not `install_stage || rc=1`: bash ignores `set -e` inside a command
    # that `||` tests, so a failed install step would not stop it.)
    set +e
    measured install_stage "$@"
    rc=$?
    echo "$rc $((SECONDS - INSTALL_START)) $MEASURED_CPU" > "$INSTALL_RESULT"
  ) > "$INSTALL_LOG" 2>&1 &
  INSTALL_PID=$!
}

install_wait() {
  local rc seconds cpu
  wait "$INSTALL_PID" || true
  INSTALL_PID=""
  printf '\n=== %s: output\n' "$INSTALL_STAGE"
  cat "$INSTALL_LOG"
  read -r rc seconds cpu < "$INSTALL_RESULT" || { rc=1 seconds=$((SECONDS - INSTALL_START)) cpu=0; }
  rm -f "$INSTALL_LOG" "$INSTALL_RESULT"
  STAGE_NAMES+=("$INSTALL_STAGE")
  STAGE_SECONDS+=("$seconds")
  STAGE_CPU+=("$cpu")
  if [ "$rc" = 0 ]; then STAGE_STATUS+=(ok); else STAGE_STATUS+=(FAILED); fi
  [ "$rc" = 0 ] || fail "$1: venv and install failed"
}

env_dir() { if [ "$1" = oldest ]; then echo .venv; else echo .venv-new; fi; }
env_python() { if [ "$1" = oldest ]; then echo "$PY_OLDEST"; else echo "$PY_NEWEST"; fi; }

ORIG_PATH=$PATH
if [ "${ENVS[*]}" = "oldest newest" ]; then
  install_start newest "$(env_dir newest)" "$(env_python newest)"
fi
for env in "${ENVS[@]}"; do
  dir=$(env_dir "$env")
  python=$(env_python "$env")
  if [ "$env" = newest ] && [ -n "$INSTALL_PID" ]; then
    install_wait "$env"
  else
    begin "$env: venv and install ($dir, $("$python" --version 2>&1))"
    measured install_stage "$env" "$dir" "$python"
    end
  fi
  # What `activate` does: `python`, `mkdocs`, ... are this environment's.
  export VIRTUAL_ENV=$ROOT/$dir PATH=$ROOT/$dir/bin:$ORIG_PATH
  hash -r
  if [ "$env" = oldest ]; then
    # The library's tests; in the background, alongside the newest stage (bg_start).
    bg_start "pytest -m 'not once'" "$env" "$OLDEST_WORKERS" -m "not once"
    continue
  fi
  # typeshed's modules parsed once for every pytype run of this stage (the gate, the
  # checker table; scripts/pytype_gate.py says how).
  if "$ROOT/$dir/bin/python" -c 'import sys; sys.exit(sys.version_info >= (3, 13))'; then
    BUILTINS_DIR=$(mktemp -d)
    EQX_OFFLOAD_PYTYPE_BUILTINS=$BUILTINS_DIR/builtins.pickle
    python scripts/pytype_gate.py --write-builtins "$EQX_OFFLOAD_PYTYPE_BUILTINS"
    export EQX_OFFLOAD_PYTYPE_BUILTINS
  fi
  side_start
  pytest_ok=1
  if [ "${CHECK_FULL:-}" = 1 ]; then
    begin "$env: pytest (all: CHECK_FULL=1)"
    run_pytest "$env" 2 || pytest_ok=0
  else
    begin "$env: pytest -m 'once or both'"
    run_pytest "$env" 2 -m "once or both" || pytest_ok=0
  fi
  if [ "$pytest_ok" = 1 ]; then end; else end FAILED; fi
  # Failed or not, the gates' output is shown before the run stops.
  side_wait "$env"
  [ "$pytest_ok" = 1 ] || fail "$env: pytest failed"
done
bg_wait
