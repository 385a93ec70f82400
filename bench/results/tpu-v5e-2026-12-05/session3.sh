. bench/tpu/setup.sh || exit 1
P="timeout 200 python3 -W ignore bench/tpu/probe.py"
$P run default 4096 8 4 2>&1 | grep -E '^\{"exp": "run|Error'
for m in plain whole default; do $P run $m 8192 16 6 2>&1 | grep -E '^\{"exp": "run|Error' | tail -3; done
