# call21: the 3.52B row's step saved by a cold process, then loaded beside the fill
. bench/tpu/setup.sh || exit 1
C=/tmp/jaxcache; mkdir -p $C
P=bench/results/tpu-v5e-2026-12-07/startup_parts.py
date -u > $OUT/date.txt
for o in compile load beside load; do
  timeout 280 python3 $P $o $C >> $OUT/parts.jsonl 2>> $OUT/parts.err
  echo "$o rc=$?"; tail -1 $OUT/parts.jsonl | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('order','total_s','bound_s','over_bound','fill_gbps','parts','serialized_bytes','losses','step_s')})"
done
