#!/usr/bin/env bash
# Call 3 of 2026-12-06c: the arithmetic 8-bit codec (h-codec 9154319) on the chip: exact
# on the TPU, its speed, and the 542M 8-bit state step's profile with it.
set -u
cd "$(dirname "$0")/../../.."
. bench/tpu/setup.sh || exit 1
HERE=bench/results/tpu-v5e-2026-12-06c
timeout 120 python3 -W ignore bench/tpu/codec_check.py > $OUT/codec_check.log 2>&1; tail -3 $OUT/codec_check.log
timeout 200 python3 -W ignore $HERE/profile_step.py state-int8state 2048 8 > $OUT/codec-int8.log 2>&1
grep '^{' $OUT/codec-int8.log | cut -c1-600 || tail -5 $OUT/codec-int8.log
