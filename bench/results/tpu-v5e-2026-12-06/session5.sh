# The model techniques on the chip: the accelerator tier (tests/accelerator, with
# test_models.py), then the capacity ladder, one process per row
# (bench/tpu/capacity_chip.py: 20 steps at sequence 1024, batch 4), largest last in each
# mode, so that a run cut by its time limit keeps the rows before it. Results under $OUT.
. bench/tpu/setup.sh || exit 1
timeout 240 bash scripts/check.sh accelerator -rA 2>&1 | grep -v "warnings.warn" > $OUT/tier.txt
tail -16 $OUT/tier.txt
row() { timeout 170 python3 -W ignore bench/tpu/capacity_chip.py "$@" 2>&1 | tail -1 | cut -c1-700; }
# d=2048: 12 layers 0.80B, 20 layers 1.18B, 28 1.57B, 40 2.14B, 52 2.71B, 64 3.28B
for layers in 12 20; do row fp32 2048 $layers; done
for layers in 28 40; do row state 2048 $layers; done
for layers in 40 52; do row +activations 2048 $layers; done
for layers in 52 64; do row +activations-bf16state 2048 $layers; done
