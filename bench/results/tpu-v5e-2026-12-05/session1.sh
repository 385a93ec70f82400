# First look: bitwise, copies, HLO of the three steps.
. bench/tpu/setup.sh || exit 1
P="timeout 300 python3 bench/tpu/probe.py"
$P copies 1024 2>&1 | grep -v Warning
$P bitwise 4096 8 5 2>&1 | tail -20
$P bitwise 2048 8 5 highest 2>&1 | tail -20
for m in plain default whole; do
  XLA_FLAGS="--xla_dump_to=/tmp/hlo/$m --xla_dump_hlo_as_text" $P run $m 4096 8 2 > /dev/null 2>&1
done
(cd /tmp/hlo && find . -name '*after_optimizations.txt' | grep -i step | tar czf $OUT/hlo.tgz -T -)
ls -la $OUT
