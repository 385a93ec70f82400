"""Each parameter stored once (docs/capacity.md), planned for a TPU v5e without one:
`bench/tpu/capacity_chip.py`'s `-once` modes (fp32 weights of the blocks in host memory
as their own master, cast to bf16 on the device as each layer is fetched; the moments in
fp32, bf16 or 8 bits; the update inside the backward pass) compile for a v5e, every host
output reuses its donated input's buffer, and the host arguments are what is stored."""

from typing import Any

import pytest
from helpers import TPU_ENV
from isolated import call_isolated
from test_backward_update_v5e import PACKAGE, plan_modes


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)


def test_the_stored_once_modes_compile_and_alias(tpu: Any) -> None:
    modes = [f"+activations-once{state}-backward" for state in ("", "-bf16state", "-int8state")]
    found = call_isolated(plan_modes, modes, 256, 2, 128, 2,
                          env={**TPU_ENV, "PYTHONPATH": PACKAGE})
    for mode in modes:
        assert isinstance(found[mode], list), (mode, found[mode])
        unaliased, arguments, stored = found[mode]
        assert unaliased == 0, mode
        # (XLA:TPU's tile padding, as in test_backward_update_v5e.py)
        slack = 20 if "int8" in mode else 100
        assert stored <= arguments <= stored + stored // slack, (mode, arguments, stored)
