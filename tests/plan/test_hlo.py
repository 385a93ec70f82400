"""Reading XLA's scheduled HLO text (`hlo`): pure parsing, nothing compiled."""

import pytest

from eqx_offload._plan.hlo import scheduled_copies
from eqx_offload._plan.loops import run_counts, unknown_loops


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


# XLA:TPU's form of a loop over 6 stacked layers: no `known_trip_count`; the counter
# (tuple element 0) starts at a copied constant 0, the body adds 1, the condition
# compares it with 6. Each trip reads one layer from host memory with an asynchronous
# `dynamic-slice-start` (XLA:TPU's own instruction, not a fusion), and writes one back.
_TPU_LOOP = """\
%cond (c: (s32[], f32[6,256]{1,0:S(5)})) -> pred[] {
  %limit = s32[]{:T(128)} constant(6)
  %c = (s32[]{:T(128)}, f32[6,256]{1,0:T(8,128)S(5)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

%body (b: (s32[], f32[6,256]{1,0:S(5)})) -> (s32[], f32[6,256]{1,0:S(5)}) {
  %one = s32[]{:T(128)} constant(1)
  %b = (s32[]{:T(128)}, f32[6,256]{1,0:T(8,128)S(5)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%b), index=0
  %h = f32[6,256]{1,0:T(8,128)S(5)} get-tuple-element(%b), index=1
  %zero.1 = s32[]{:T(128)} constant(0)
  %ds.start = ((f32[6,256]{1,0:T(8,128)S(5)}, s32[], s32[]), f32[1,256]{1,0:T(8,128)}, u32[]{:S(2)}) dynamic-slice-start(%h, %j, %zero.1), dynamic_slice_sizes={1,256}
  %ds.done = f32[1,256]{1,0:T(8,128)} dynamic-slice-done(%ds.start)
  %t = f32[1,256]{1,0:T(8,128)} fusion(%ds.done), kind=kLoop
  %dus.start = ((f32[6,256]{1,0:T(8,128)S(5)}, f32[1,256]{1,0:T(8,128)}, s32[]{:T(128)}, s32[]{:T(128)}), f32[6,256]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%h, %t, %j, %zero.1)
  %dus.done = f32[6,256]{1,0:T(8,128)S(5)} dynamic-update-slice-done(%dus.start)
  %copy.2 = s32[]{:T(128)S(6)} copy(%j)
  %next = s32[]{:T(128)} add(%copy.2, %one)
  ROOT %r = (s32[]{:T(128)}, f32[6,256]{1,0:T(8,128)S(5)}) tuple(%next, %dus.done)
}

ENTRY %main (x: f32[6,256]) -> f32[6,256] {
  %x = f32[6,256]{1,0:T(8,128)S(5)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %copy.1 = s32[]{:T(128)} copy(%zero)
  %t0 = (s32[]{:T(128)}, f32[6,256]{1,0:T(8,128)S(5)}) tuple(%copy.1, %x)
  %w = (s32[]{:T(128)}, f32[6,256]{1,0:T(8,128)S(5)}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[6,256]{1,0:T(8,128)S(5)} get-tuple-element(%w), index=1
}
"""


def test_a_tpu_loop_counts_each_trip_of_its_slices() -> None:
    """XLA:TPU writes no trip count: it is read from the loop's counter, and its
    `dynamic-slice-start`/`dynamic-update-slice-start` between host and device are
    copies, each run once per trip."""
    copies = [(c.name, c.direction, c.nbytes, c.count, c.overlapped)
              for c in scheduled_copies(_TPU_LOOP)]
    assert copies == [("ds.start", "to_device", 1024, 6, False),
                      ("dus.start", "to_host", 1024, 6, False)]
    assert run_counts(_TPU_LOOP)["body"] == 6 and unknown_loops(_TPU_LOOP) == ()


def test_each_copy_has_its_computation_and_positions_in_the_schedule() -> None:
    """Where a copy starts and completes in its computation's schedule: what is in
    flight at once (the time model replays it)."""
    copies = [(c.computation, c.start, c.done) for c in scheduled_copies(_TPU_LOOP)]
    assert copies == [("body", 6, 7), ("body", 9, 10)]


@pytest.mark.parametrize("limit, direction, start, step, trips", [
    (6, "LT", 0, 1, 6), (6, "LE", 0, 1, 7), (7, "LT", 1, 2, 3), (0, "GT", 5, -1, 5)])
def test_trip_counts_of_each_loop_form(limit, direction, start, step, trips) -> None:
    hlo = (_TPU_LOOP.replace("constant(6)", f"constant({limit})")
           .replace("direction=LT", f"direction={direction}")
           .replace("%zero = s32[]{:T(128)} constant(0)", f"%zero = s32[]{{:T(128)}} constant({start})")
           .replace("%one = s32[]{:T(128)} constant(1)", f"%one = s32[]{{:T(128)}} constant({step})"))
    assert run_counts(hlo)["body"] == trips


def test_a_loop_of_another_form_counts_once_and_is_named() -> None:
    """A counter that is not a constant's (here: read from the input) leaves the trip
    count unknown: the body counts once, and `unknown_loops` names the loop."""
    hlo = _TPU_LOOP.replace("%copy.1 = s32[]{:T(128)} copy(%zero)",
                            "%copy.1 = s32[]{:T(128)} fusion(%x), kind=kLoop")
    assert run_counts(hlo)["body"] == 1 and unknown_loops(hlo) == ("w",)
