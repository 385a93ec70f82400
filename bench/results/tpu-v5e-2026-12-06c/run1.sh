#!/usr/bin/env bash
# Call 1 of 2026-12-06c on the chip: the link inside a loop, and where the state and
# 8-bit state steps' time goes (542M decoder). One process per row; JSON lines in $OUT.
set -u
cd "$(dirname "$0")/../../.."
. bench/tpu/setup.sh || exit 1
HERE=bench/results/tpu-v5e-2026-12-06c
python3 -c 'import platform, jax; print(platform.libc_ver(), jax.__version__, jax.devices())'
for cfg in "64 1 16" "64 1 16 2" "64 2 8" "64 4 4" "16 1 64" "4 1 256" "256 1 4" "256 2 2"; do
  timeout 60 python3 -W ignore $HERE/link_loop.py $cfg 2>&1 | grep '^{' | tee -a $OUT/link_loop.jsonl \
    || echo "{\"cfg\": \"$cfg\", \"error\": \"no result\"}" | tee -a $OUT/link_loop.jsonl
done
for mode in state-int8state state; do
  timeout 200 python3 -W ignore $HERE/profile_step.py $mode 2048 8 > $OUT/$mode.log 2>&1
  grep '^{' $OUT/$mode.log | cut -c1-3000 || tail -5 $OUT/$mode.log
done
