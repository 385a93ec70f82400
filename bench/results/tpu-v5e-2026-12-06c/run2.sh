#!/usr/bin/env bash
# Call 2 of 2026-12-06c: the link inside a loop, the write independent of the fetch and
# the fetch software-pipelined (one process per row; JSON lines in $OUT/link_loop2.jsonl).
set -u
cd "$(dirname "$0")/../../.."
HERE=bench/results/tpu-v5e-2026-12-06c
for cfg in "64 1 16 1 indep" "64 1 16 1 pipe" "16 1 64 1 pipe" "4 1 256 1 pipe" "64 4 4 1 pipe" "256 1 4 1 pipe" "64 1 16 2 pipe"; do
  timeout 60 python3 -W ignore $HERE/link_loop.py $cfg 2>&1 | grep '^{' | tee -a $OUT/link_loop2.jsonl \
    || echo "{\"cfg\": \"$cfg\", \"error\": \"no result\"}" | tee -a $OUT/link_loop2.jsonl
done
