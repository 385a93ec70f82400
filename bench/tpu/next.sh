#!/usr/bin/env bash
# The chip's rows for this round, most telling first, one process per row, each result a
# JSON line under $OUT (capacity, throughput, startup, host_rss, stopped and failed .jsonl).
#
#   bash bench/tpu/next.sh N    # call N, at most 9 minutes (what it runs: `callN` below)
#   SIZE=small bash bench/tpu/next.sh all   # every row at a size the CPU runs (the tests)
#   DRY=1 bash bench/tpu/next.sh all        # print each row (script and arguments), run none
#
# A row is stopped (reported in stopped.jsonl with its last progress line) when the memory
# left falls under FLOOR_GIB (default 3): the least of MemAvailable, the cgroup's limit less
# its use, and RAM_GIB (default 40, the device machine's) less this user's resident memory.
set -u
cd "$(dirname "$0")/../.."
CALL=${1:-1}
OUT=${OUT:-$(mktemp -d)}
export OUT
FLOOR_GIB=${FLOOR_GIB:-3}
RAM_GIB=${RAM_GIB:-40}
if [ "${SIZE:-}" = small ]; then
  # Every row at a size the CPU runs in seconds: width 128, 2 layers (4: a larger model), 32x2
  W=128; L8=2; LBIG=4; SEQB="32 2"; STEPS=2; MIB=16; T=300
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
else
  [ -n "${DRY:-}" ] || . bench/tpu/setup.sh || exit 1
  W=2048; L8=8; LBIG=40; SEQB="1024 4"; STEPS=6; MIB=1024; T=170
fi

left_gib() {  # the memory left for rows, in GiB: the least of the three measures above
  local kib rss d lim use
  kib=$(awk '/MemAvailable/ { print $2 }' /proc/meminfo)
  for d in "/sys/fs/cgroup$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)" \
           "/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" { print $3 }' /proc/self/cgroup)"; do
    lim=$(cat "$d/memory.max" "$d/memory.limit_in_bytes" 2> /dev/null | head -1)
    use=$(cat "$d/memory.current" "$d/memory.usage_in_bytes" 2> /dev/null | head -1)
    if [ -n "$lim" ] && [ "$lim" != max ] && [ "${#lim}" -lt 16 ] && [ -n "$use" ]; then
      kib=$(( (lim - use) / 1024 < kib ? (lim - use) / 1024 : kib ))
    fi
  done
  rss=$(ps -u "$(id -u)" -o rss= | awk '{ s += $1 } END { print s + 0 }')
  kib=$(( RAM_GIB * 1048576 - rss < kib ? RAM_GIB * 1048576 - rss : kib ))
  echo $(( kib / 1048576 ))
}

row() {  # SECONDS SCRIPT ARGS...: one process, stopped if the host runs low on memory
  local limit=$1 log pid left stopped=""
  shift
  [ -n "${DRY:-}" ] && { echo "$*"; return; }
  log=$(mktemp)
  ROW_SECONDS=$((limit - 15)) setsid timeout "$limit" "${PYTHON:-python3}" -W ignore "$@" > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2> /dev/null; do
    left=$(left_gib)
    if [ "$left" -lt "$FLOOR_GIB" ]; then
      kill -9 -- "-$pid" 2> /dev/null
      { grep '^{' "$log" | tail -1; echo "{\"row\": \"$*\", \"error\": \"stopped: the memory left fell to $left GiB\"}"; } \
        | tee -a "$OUT/stopped.jsonl"
      stopped=1
    fi
    sleep 0.5
  done
  wait "$pid"
  grep '^{' "$log" | tail -1 | cut -c1-1200
  if [ -z "$stopped" ] && ! grep -q '^{' "$log"; then  # (a row that made no JSON line)
    echo "{\"row\": \"$*\", \"error\": \"no result: $(tail -1 "$log" | tr -d '"\\' | cut -c1-300)\"}" \
      | tee -a "$OUT/failed.jsonl"
  fi
  rm -f "$log"
}

R="bench/train.py"  # MODE WIDTH LAYERS STEPS SEQ BATCH [--micro K] [--file NAME]
TP="--file throughput"
call1() {  # the update in the backward pass against the normal step, 542M, 4k tokens
  row $T $R fp32 $W $L8 $STEPS $SEQB $TP
  row $T $R state $W $L8 $STEPS $SEQB $TP
  row $T $R state-backward $W $L8 $STEPS $SEQB $TP
  row $T $R state-int8state $W $L8 $STEPS $SEQB $TP
  row $T $R +activations $W $L8 $STEPS $SEQB $TP
  row $T $R +activations-backward $W $L8 $STEPS $SEQB $TP
}
call6() {  # where the host's resident memory goes: primitives, then each mode's start-up
  row $T bench/host_rss.py primitives $MIB
  row $T bench/host_rss.py startup +activations-bf16state $W $L8 2
  row $T bench/host_rss.py startup state $W $L8 2
}
call9() {  # 3.52B stored once (fp32 master, 8-bit moments; 66 layers): inputs on host, then not
  local l=66; [ "${SIZE:-}" = small ] && l=2
  row $((T + 95)) $R +activations-once-int8state-backward $W $l 20 $SEQB
  row $((T + 95)) $R +params-once-int8state-backward $W $l 20 $SEQB
}
call11() {  # fp32 weights and fp32 moments stored once, 1.83B (33 layers, 21.40 GB stored)
  local l=33; [ "${SIZE:-}" = small ] && l=2
  row $((T + 95)) $R +activations-once-backward $W $l 20 $SEQB
}
call12() {  # 542M's step in each mode of issue 62's ratios, one run
  for m in fp32 state state-int8state state-backward state-int8state-backward; do
    row $T $R $m $W $L8 $STEPS $SEQB $TP
  done
}
call13() {  # where a step's time goes (`jax.profiler`): 542M `state`, in backward, 8-bit in
  # backward; then 2.19B all in host memory (fp32 master stored once, bf16 moments)
  local p=bench/results/tpu-v5e-2026-12-07/profile.py m=state-backward
  [ "${SIZE:-}" = small ] && [ -z "${DRY:-}" ] && { row $T $p $m $W $L8 $SEQB; return; }
  for m in state state-backward state-int8state-backward; do row $T $p $m $W $L8 $SEQB; done
  row $((T + 90)) $R +activations-once-bf16state-backward $W $LBIG 20 $SEQB
}
call14() {  # call 9's 2nd row, 3 steps, cache; then --beside (18: the step saved, then loaded)
  local l=66 c=/tmp/jaxcache m=+params-once-int8state-backward
  [ "${SIZE:-}" = small ] && { l=2; c=$OUT/jaxcache; }
  [ -n "${DRY:-}" ] || rm -rf "$c"
  [ "${1:-}" = saved ] && { for o in compile load beside load; do
    row $((T + 110)) bench/results/tpu-v5e-2026-12-07/startup_parts.py $o "$c" $m $W $l; done; return; }
  row $((T + 210)) $R $m $W $l 3 $SEQB --cache "$c"  # (cold)
  row $((T + 95)) $R $m $W $l 3 $SEQB --cache "$c" --beside
}
call15() {  # 64k tokens per optimizer step (16 micro-batches), each mode against plain
  for m in fp32 state state-int8state state-bf16state state-backward; do
    row $T $R $m $W $L8 4 $SEQB --micro 16 $TP
  done
  row $((T + 90)) $R state-int8state-backward $W $L8 4 $SEQB --micro 16 $TP  # (~103 s compile)
}
call16() {  # 542M in backward against the normal step at 4k and 64k tokens; 2.19B as call13
  for m in fp32 state state-backward; do row $T $R $m $W $L8 $STEPS $SEQB $TP; done
  for m in fp32 state-backward; do row $T $R $m $W $L8 4 $SEQB --micro 16 $TP; done
  row $((T + 90)) $R +activations-once-bf16state-backward $W $LBIG 20 $SEQB
}
call17() {  # one host array made 3 ways; 2.19B (call13's) with its step compiled first
  local z=bench/results/tpu-v5e-2026-12-07/zeros_rss.py c=/tmp/jaxcache
  [ "${SIZE:-}" = small ] && c=$OUT/jaxcache
  for r in stacked whole numpy buffer writes; do for d in float32 bfloat16; do row 60 $z $r $d $MIB; done; done
  [ -n "${DRY:-}" ] || rm -rf "$c"
  row $((T + 120)) $R +activations-once-bf16state-backward $W $LBIG 20 $SEQB --cache "$c" --compile-first
}
case $CALL in
  1) call1 ;; 6) call6 ;; 9) call9 ;; 11) call11 ;; 12) call12 ;; 13) call13 ;;
  14) call14 ;; 15) call15 ;; 16) call16 ;; 17) call17 ;; 18) call14 saved ;;
  all) call1; call6; call9; call11; call12; call13; call14; call15; call16; call17 ;;
  *) echo "usage: $0 1|6|9|11|12|13|14|15|16|17|18|all" >&2; exit 2 ;;
esac
[ -n "${DRY:-}" ] || echo "results: $OUT"
