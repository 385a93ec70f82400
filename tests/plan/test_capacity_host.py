"""The host's bound of the capacity table for one v5e (`bench/capacity_host.py`), from
shapes (the row the chip runs, `bench/train.py`, is tests/test_chip_script.py's)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import capacity_host  # (bench/: scripts of the repository)
import harness
from llama import LlamaShape


GB = 10**9


@pytest.mark.parametrize("name,per_param", [
    ("state", 8.0),  # AdamW's two fp32 moments
    ("+master", 12.0),  # and the fp32 master weights
    ("+master-bf16state", 8.0),  # fp32 master weights, the moments in bf16
])
def test_host_arrays_are_the_bytes_each_mode_stores(name: str, per_param: float) -> None:
    host, device = capacity_host.host_arrays(name, 4)
    params = harness.llama_shape(2048, 4).params
    assert host == per_param * params
    assert device > 0


def test_the_step_host_extra_is_the_blocks_gradients_and_inputs() -> None:
    shape = harness.llama_shape(2048, 30)
    assert capacity_host.step_host_extra("+master", 30) == 0
    grads = 2 * shape.block_params * 30
    assert capacity_host.step_host_extra("+params", 30) == grads
    inputs = 30 * shape.batch * shape.seq * shape.width * 2
    assert capacity_host.step_host_extra("+activations", 30) == grads + inputs


def test_from_bytes_is_the_largest_depth_within_the_host() -> None:
    row = capacity_host.from_bytes("+master", 40 * GB, 14 * GB, 60)
    assert row["layers"] == 39  # 2.14B: 25.6 GB of arrays beside the runtime's 14 GB
    assert row["host"] + 14 * GB <= 40 * GB
    above = harness.llama_shape(2048, 40).params * 12
    assert above + 14 * GB > 40 * GB
    eight = capacity_host.from_bytes("+master", 40 * GB, 14 * GB, 120, eight_bit=True)
    assert 6.0 < eight["host_per_param"] < 6.1 and eight["layers"] > row["layers"]


def test_the_llama_shape_is_the_chips() -> None:
    assert harness.llama_shape(2048, 20) == LlamaShape("d2048x20", 2048, 20, 16, 16, 5632,
                                                       32000, seq=1024, batch=4)
