# The accelerator tier, 1.95B parameters, the demo, the fenced whole state under memory
# pressure, and the benchmark; each result under $OUT as it comes.
. bench/tpu/setup.sh || exit 1
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
  --index-url file:///opt/pypi/simple --target /tmp/site2 matplotlib > /dev/null 2>&1 &
timeout 200 bash scripts/check.sh accelerator -rA 2>&1 | grep -v "warnings.warn" > $OUT/tier.txt
tail -22 $OUT/tier.txt
P="python3 -W ignore bench/tpu/probe.py"
timeout 110 $P run default 8192 28 3 2>&1 | grep -E '^\{"exp": "run|Error' | cut -c1-900
timeout 60 python3 -W ignore -m eqx_offload demo --platform tpu --no-progress \
  --json $OUT/demo.json > $OUT/demo.txt 2>&1; tail -6 $OUT/demo.txt
timeout 90 $P run whole 8192 16 5 2>&1 | grep -E '^\{"exp": "run|Error' | cut -c1-900
wait
export PYTHONPATH=$PYTHONPATH:/tmp/site2
timeout 150 python3 -W ignore -m eqx_offload bench --platform tpu --sizes 1.5e8 --workloads mlp \
  --optimizers adam --modes baseline eqx_offload whole_state host_bf16 --batch 512 \
  --repeats 5 --warmup 2 --movers --no-progress --time-limit 110 --out /tmp/bench 2>&1 | tail -30
cp /tmp/bench/bench.json /tmp/bench/bench.md $OUT/ 2>/dev/null; ls $OUT
