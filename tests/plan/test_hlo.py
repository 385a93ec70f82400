"""Reading XLA's scheduled HLO text (`hlo`): pure parsing, nothing compiled."""

from eqx_offload._plan.hlo import scheduled_copies


# A host computation in a loop body of 4 trips, as XLA's GPU plan writes one for
# `compute_on("device_host")`: it reads a host operand and a device operand, writes its
# result to device memory, and a copy takes the result back to host memory.
_HLO = """\
%body (p: (s32[], f32[256]{0:S(5)})) -> (s32[], f32[256]{0:S(5)}) {
  %a = f32[256]{0:S(5)} get-tuple-element(%p), index=1
  %g = bf16[256]{0} fusion(%a), kind=kLoop
  %h.start = ((f32[256]{0:S(5)}, bf16[256]{0}), f32[256]{0}, u32[]) custom-call-start(%a, %g), async_execution_thread="host", custom_call_target="HostExecute"
  %k = f32[8]{0} fusion(%g), kind=kLoop
  %h.done = f32[256]{0} custom-call-done(%h.start)
  %c.start = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%h.done)
  %c.done = f32[256]{0:S(5)} copy-done(%c.start)
}

ENTRY %main (x: f32[256]) -> f32[256] {
  %w = (s32[], f32[256]{0:S(5)}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_host_call_reads_and_writes_device_memory_as_copies():
    copies = {(c.name, c.direction): c for c in scheduled_copies(_HLO)}
    assert {key: (c.nbytes, c.count, c.kernels) for key, c in copies.items()} == {
        ("h.start", "to_host"): (512, 4, 1),  # the bf16 operand in device memory
        ("h.start", "to_device"): (1024, 4, 1),  # the f32 result, written to the device
        ("c.start", "to_host"): (1024, 4, 0),  # and copied back
    }


def test_only_copies_to_or_from_host_memory_count() -> None:
    """A copy between device memories (XLA:TPU's prefetch into `S(1)`) is no transfer."""
    hlo = """\
ENTRY %main (x: f32[8,1024]) -> f32[8,1024] {
  %a.start = (f32[8,1024]{1,0:T(8,128)S(1)}, f32[8,1024]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%x)
  %a.done = f32[8,1024]{1,0:T(8,128)S(1)} copy-done(%a.start)
  %b.start = (f32[8,1024]{1,0:T(8,128)}, f32[8,1024]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%h)
  %b.done = f32[8,1024]{1,0:T(8,128)} copy-done(%b.start)
}
"""
    assert [(c.name, c.direction, c.nbytes) for c in scheduled_copies(hlo)] == [
        ("b.start", "to_device", 8 * 1024 * 4)]
