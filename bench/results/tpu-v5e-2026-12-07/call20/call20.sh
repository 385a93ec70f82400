# call20: the 3.52B row's second start-up, its parts timed in four orders (startup_parts.py)
. bench/tpu/setup.sh || exit 1
C=/tmp/jaxcache; mkdir -p $C
P=bench/results/tpu-v5e-2026-12-07/startup_parts.py
M=+params-once-int8state-backward
date -u > $OUT/date.txt
( time timeout 280 python3 bench/train.py $M 2048 66 1 1024 4 --cache $C --compile-only ) > $OUT/compiled.jsonl 2> $OUT/compiled.err
tail -c 400 $OUT/compiled.jsonl
for o in seq loadonly fillfirst beside; do
  timeout 95 python3 $P $o $C >> $OUT/parts.jsonl 2>> $OUT/parts.err
  echo "$o rc=$?"; tail -1 $OUT/parts.jsonl | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('order','total_s','bound_s','over_bound','fill_gbps','gil_stalled_s','parts','serialized_bytes')})"
done
free -g | head -2
