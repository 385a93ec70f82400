# Determinism, the copy floor, and the large runs each in a process of its own.
. bench/tpu/setup.sh || exit 1
P="timeout 280 python3 -W ignore bench/tpu/probe.py"
$P determinism 4096 8 2>&1 | grep '^{'
$P floor 4096 8 2>&1 | grep '^{'
$P run default 4096 8 4 2>&1 | grep '^{'
for m in plain whole default; do $P run $m 8192 16 6 2>&1 | grep -E '^\{|Error' | tail -3; done
$P run plain 8192 16 6 keep 2>&1 | grep -E '^\{|Error' | tail -3
