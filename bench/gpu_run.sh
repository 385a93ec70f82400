#!/usr/bin/env bash
# The GPU benchmark in one command, for a rented accelerator machine (see
# docs/benchmark.md, "Running it on a GPU"):
#
#     OUT=/some/folder bash bench/gpu_run.sh                  # on the GPU machine
#     OUT=/tmp/smoke bash bench/gpu_run.sh --platform cpu --sizes 2e4 \
#         --lm-vocab 64 --lm-width 32 --lm-layers 1 --lm-heads 2 --lm-seq 16 \
#         --lm-batch 4 --repeats 2 --warmup 1 --movers 1 --loss-steps 4 \
#         --time-limit 600                                   # the same on the CPU, tiny
#
# It installs nothing: it runs the checkout (PYTHONPATH) with the machine's own
# python3, which must have jax, equinox, optax, jaxtyping, numpy, rich, tqdm and
# matplotlib (the H200 image has them all; see /work/.library/device/KINDS.md). Extra
# arguments are passed to `python -m eqx_offload bench` after the defaults below, so
# they override them.
#
# Writes to $OUT (default bench-out/gpu), at most 8 files: bench.json, bench.md, the
# PNG plots (step_time_ratio, floor_ratio, device_bytes, movers, loss_curves) and
# gpu_run.log. The benchmark stops starting new points after --time-limit seconds
# (default 360) and still writes every file, so the whole command ends in about
# 7 minutes on an H200; `timeout` bounds it at 560 s in any case. Exit status: the
# benchmark's (1 if a mode failed or a bitwise mode differed; the files are written
# anyway).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/bench-out/gpu}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
export PYTHONUNBUFFERED=1

# Run the checkout without installing it. `eqx_offload.__version__` reads the installed
# package's metadata; where the package is not installed, a metadata folder (no code)
# stands in for it.
META="$(mktemp -d)"
trap 'rm -rf "$META"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import importlib.metadata as m; m.version("eqx_offload")' 2>/dev/null; then
  VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)"
  mkdir -p "$META/eqx_offload-$VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: eqx_offload\nVersion: %s\n' "$VERSION" \
    > "$META/eqx_offload-$VERSION.dist-info/METADATA"
  export PYTHONPATH="$PYTHONPATH:$META"
fi

{
  echo "== $(date -u +%FT%TZ) bench/gpu_run.sh $*"
  echo "== commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
  "$PYTHON" -c 'import sys, jax, equinox, optax, eqx_offload
print("python", sys.version.split()[0], "jax", jax.__version__, "equinox", equinox.__version__,
      "optax", optax.__version__, "eqx_offload", eqx_offload.__version__, "from", eqx_offload.__file__)'
} 2>&1 | tee "$LOG"

# The defaults: the transformer first, then the MLP sweep, with Adam only (Adafactor's
# state is too small for its copies to matter; the older GPU run has it); every mode,
# whole_state and host_bf16 included; loss curves of full precision (bitwise, a check) and host_bf16
# against the baseline.
timeout 560 "$PYTHON" -m eqx_offload bench \
  --platform default --out "$OUT" --no-progress \
  --workloads transformer mlp \
  --lm-vocab 8192 --lm-width 768 --lm-layers 8 --lm-heads 12 --lm-seq 512 --lm-batch 32 \
  --sizes 1e6 1e7 1e8 --optimizers adam --batch 32 \
  --modes baseline manual eqx_offload streamed whole_state host_compute host_bf16 \
  --repeats 9 --warmup 2 \
  --movers 16 64 256 \
  --loss-curves eqx_offload host_bf16 --loss-steps 150 \
  --time-limit 360 \
  "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "== exit status $status; files in $OUT:" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
exit "$status"
