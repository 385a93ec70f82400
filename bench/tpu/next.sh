#!/usr/bin/env bash
# The chip's rows for this round, most telling first, one process per row, each result a
# JSON line under $OUT (capacity.jsonl, throughput.jsonl, startup.jsonl, stopped.jsonl).
#
#   bash bench/tpu/next.sh 1    # call 1 (<= 9 min): the update in the backward pass, 542M
#   bash bench/tpu/next.sh 2    # call 2 (<= 9 min): 64k tokens a step; past 2B; 8-bit
#   bash bench/tpu/next.sh 3    # call 3 (<= 9 min): the capacity rows (everything in host)
#   bash bench/tpu/next.sh 4    # call 4 (<= 9 min): start-up routes, threads
#   bash bench/tpu/next.sh 5    # call 5 (<= 9 min): the fp32-state capacity row; 8-bit 542M
#   SIZE=small bash bench/tpu/next.sh all   # every row at a size the CPU runs (the tests)
#
# No row can run the host out of memory: each row is stopped (and reported in
# stopped.jsonl) when the host's available memory falls under FLOOR_GIB (default 3), and
# the capacity rows' sizes keep their planned host bytes under the host's available
# memory after the TPU runtime started (42.8 GB measured on 2026-12-06: the runtime's own
# share is 5.1 GB of RAM, though its RSS is 13.9 GB).
set -u
cd "$(dirname "$0")/../.."
CALL=${1:-1}
OUT=${OUT:-$(mktemp -d)}
export OUT
FLOOR_GIB=${FLOOR_GIB:-3}
if [ "${SIZE:-}" = small ]; then
  # Every row's script, at a size the CPU runs in seconds: width 128, 2 layers,
  # sequence 32, batch 2 (4 layers where a row tests a larger model).
  W=128; L8=2; LBIG=4; SEQB="32 2"; STEPS=2; MIB=16; T=300
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
else
  . bench/tpu/setup.sh || exit 1
  W=2048; L8=8; LBIG=40; SEQB="1024 4"; STEPS=6; MIB=1024; T=170
fi

row() {  # SECONDS SCRIPT ARGS...: one process, stopped if the host runs low on memory
  local limit=$1 log pid avail
  shift
  log=$(mktemp)
  ROW_SECONDS=$((limit - 15)) setsid timeout "$limit" "${PYTHON:-python3}" -W ignore "$@" > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2> /dev/null; do
    avail=$(awk '/MemAvailable/ { print int($2 / 1048576) }' /proc/meminfo)
    if [ "$avail" -lt "$FLOOR_GIB" ]; then
      kill -9 -- "-$pid" 2> /dev/null
      echo "{\"row\": \"$*\", \"error\": \"stopped: the host's available memory fell to $avail GiB\"}" \
        | tee -a "$OUT/stopped.jsonl"
    fi
    sleep 0.5
  done
  wait "$pid"
  grep '^{' "$log" | tail -1 | cut -c1-1200
  rm -f "$log"
}

C="bench/tpu/capacity_chip.py"
TP="bench/tpu/throughput.py"
call1() {  # the update in the backward pass against the normal step, 542M, 4k tokens
  row $T $TP fp32 $W $L8 1 $STEPS $SEQB
  row $T $TP state $W $L8 1 $STEPS $SEQB
  row $T $TP state-backward $W $L8 1 $STEPS $SEQB
  row $T $TP state-int8state $W $L8 1 $STEPS $SEQB
  row $T $TP +activations $W $L8 1 $STEPS $SEQB
  row $T $TP +activations-backward $W $L8 1 $STEPS $SEQB
}
call2() {  # 64k tokens per optimizer step (16 micro-batches); the backward update past 2B
  row $T $TP fp32 $W $L8 16 4 $SEQB
  row $T $TP state $W $L8 16 4 $SEQB
  row $T $TP state-backward $W $L8 16 4 $SEQB
  row $T $C state-backward $W $LBIG 4 $SEQB
}
call3() {  # capacity with everything in host memory, the state in 8 bits, bf16, fp32:
  # 20 steps; bf16 and fp32 with the stacked blocks updated in the backward pass
  local l17=31 l235=44 l29=54 t=$((T + 90))
  [ "${SIZE:-}" = small ] && { l17=2; l235=2; l29=2; t=$T; }
  row $t $C +activations-int8state $W $l29 20 $SEQB
  row $t $C +activations-bf16state-backward $W $l235 20 $SEQB
}
call5() {  # the last capacity row and the 8-bit state on the normal step
  local l17=31
  [ "${SIZE:-}" = small ] && l17=2
  row $((T + 90)) $C +activations-backward $W $l17 20 $SEQB
  row $T $TP state-int8state $W $L8 1 $STEPS $SEQB
}
call4() {  # start-up: new pinned memory by route
  for route in threads numpy fresh; do row 90 bench/tpu/startup_probe.py $route $MIB 4; done
}
case $CALL in
  1) call1 ;; 2) call2 ;; 3) call3 ;; 4) call4 ;; 5) call5 ;;
  all) call1; call2; call3; call4; call5 ;;
  *) echo "usage: $0 1|2|3|4|5|all" >&2; exit 2 ;;
esac
echo "results: $OUT"
