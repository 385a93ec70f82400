# Sourced on the TPU machine: install the carried wheels under /tmp/site, the source tree first.
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || return 1
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site PYTHONUNBUFFERED=1
