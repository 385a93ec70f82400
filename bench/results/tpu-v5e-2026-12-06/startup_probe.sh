# The start-up probe of docs/capacity.md: one route per process (bench/tpu/startup_probe.py).
export PYTHONUNBUFFERED=1
r() { timeout 90 env "$@" 2>&1 | grep '^{' | tail -1 | cut -c1-3000; }
P="python3 -W ignore bench/tpu/startup_probe.py"
r $P fresh 1024 3
r $P donate 1024 4
r $P reuse 1024 3
r $P device_put 1024 2
r $P unpinned 1024 2
r $P chunks 1024 2
r TPU_PREMAPPED_BUFFER_SIZE=17179869184 $P fresh 1024 3
r $P fresh 4096 1
free -b | head -3
