"""The host<->device copies and the collectives of a step, read from the text of XLA's
scheduled HLO module: pure parsing, no JAX. `plan` builds its `Plan` from them; what
they show for `offloaded` is in `docs/gpu-plan.md`.
"""

import dataclasses
import re
from typing import Literal, Optional

from .loops import COMPUTATION, computations, conditional_computations, run_counts


Direction = Literal["to_device", "to_host"]


@dataclasses.dataclass(frozen=True)
class PlannedCopy:
    """One asynchronous copy between host and device memory in XLA's schedule.

    **Fields:** `direction` (`"to_device"` or `"to_host"`), `nbytes` (one execution),
    `overlapped` (at least one kernel is scheduled between the copy's start and its
    completion), `kernels` (how many), `name` (the `copy-start` instruction), `count`
    (how many times the step runs it: the trip counts of the loops around it, e.g. a
    layer's weight fetch in a scan over 32 layers runs 32 times), `conditional` (it is
    in a branch of a conditional, so it runs only when that branch is taken: the
    applying mini-step's copies of `offloaded(MultiSteps(...))`; `count` and
    `Plan.bytes_moved` count it as taken), `computation` (the HLO computation it is
    scheduled in), `start` and `done` (the positions of its start and its completion in
    that computation's schedule, which say what is in flight at once; -1: not known). A
    host computation's reads from and writes to device memory are copies too (`name` is
    its `custom-call-start`)."""

    direction: Direction
    nbytes: int
    overlapped: bool
    kernels: int
    name: str
    count: int = 1
    conditional: bool = False
    computation: str = ""
    start: int = -1
    done: int = -1


@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    """One collective operation between devices in XLA's schedule of a multi-device
    step (per device).

    **Fields:** `kind` (`"all-gather"`, `"reduce-scatter"`, `"all-reduce"`,
    `"all-to-all"` or `"collective-permute"`), `nbytes` (the bytes of its result on
    one device, one execution), `count` (how many times the step runs it), `name`
    (the instruction)."""

    kind: str
    nbytes: int
    count: int
    name: str


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[^}]*)\})?")
_OPERAND = re.compile(r"%([^\s,()]+)")

# Instructions that launch no kernel: bookkeeping, and the copies themselves.
_NOT_COMPUTE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
    "copy-done", "after-all", "opt-barrier", "partition-id", "replica-id",
    "add-dependency", "iota", "broadcast", "reshape",
    # XLA:TPU's asynchronous slices are DMAs, not kernels.
    "slice-start", "slice-done", "dynamic-slice-start", "dynamic-slice-done",
    "dynamic-update-slice-start", "dynamic-update-slice-done",
})

_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4}


def _array_bytes(match: "re.Match[str]") -> int:
    dtype = match.group("dtype")
    bits = _BITS.get(dtype) or int(re.sub(r"[^0-9]", "", dtype.split("e")[0]) or 8)
    n = 1
    for d in filter(None, match.group("dims").split(",")):
        n *= int(d)
    return n * bits // 8


def _on_host(match: "re.Match[str]") -> bool:
    """Whether an array's layout puts it in host memory (XLA's memory space 5)."""
    return "S(5)" in (match.group("layout") or "")


def _device_bytes(shapes: str) -> int:
    """The bytes of the arrays in a shape's text that are in device memory."""
    return sum(_array_bytes(m) for m in _ARRAY.finditer(shapes) if not _on_host(m))


# Asynchronous slices: XLA's GPU compiler writes them as a `fusion-start` of a
# `dynamic-slice` or `dynamic-update-slice`, XLA:TPU as these instructions of their own.
_SLICE_STARTS = frozenset({"fusion-start", "dynamic-slice-start",
                           "dynamic-update-slice-start", "slice-start"})
_DONES = frozenset({"copy-done", "fusion-done", "dynamic-slice-done",
                    "dynamic-update-slice-done", "slice-done"})


def _slice_copy(rest: str, op: "re.Match[str]") -> Optional[tuple[Direction, int]]:
    """An asynchronous slice that copies rows between host and device memory (a
    `dynamic-slice` from a host buffer, or a `dynamic-update-slice` into one: the
    streamed update's pieces of a stacked leaf, a layer's weights fetched in a loop):
    its direction and bytes."""
    if op.group("op") == "fusion-start" and (
            "dynamic-slice" not in rest and "dynamic-update-slice" not in rest):
        return None
    arrays = list(_ARRAY.finditer(rest[: op.start()]))  # operands..., destination, context
    n_operands = len(_OPERAND.findall(rest[op.end(): rest.find(")", op.end())]))
    if len(arrays) <= n_operands:
        return None
    destination, operands = arrays[n_operands], arrays[:n_operands]
    if _on_host(destination):
        moved = [m for m in operands if not _on_host(m) and m.group("dims")]
        return ("to_host", sum(map(_array_bytes, moved))) if moved else None
    if any(_on_host(m) for m in operands):
        return "to_device", _array_bytes(destination)
    return None


def _host_copy(rest: str, op: "re.Match[str]") -> Optional[tuple[Direction, int]]:
    """A `copy-start` between host and device memory: its direction and bytes. Its
    shape is `(destination, source, context)`; a copy between two device memories (on a
    TPU, XLA's prefetches into and out of its alternate memory, `S(1)`) is none."""
    destination, source = (list(_ARRAY.finditer(rest[: op.start()])) + [None, None])[:2]
    if destination is None:
        return None
    if _on_host(destination):
        return "to_host", _array_bytes(destination)
    if source is not None and _on_host(source):
        return "to_device", _array_bytes(destination)
    return None


# A host computation (`compute_on("device_host")`): XLA's GPU runtime reads its
# operands from, and writes its results to, the memories their layouts name, so each of
# those in device memory crosses PCIe like a copy.
_HOST_CALL = 'custom_call_target="HostExecute"'


def _device_operand_bytes(rest: str) -> int:
    """The bytes of a host call's operands in device memory: the first group of its
    `custom-call-start` shape, `((operands...), results, context)`."""
    depth, end = 0, 0
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 1 and char == ")":
            end = i
            break
    return _device_bytes(rest[1: end + 1])


def _host_call_copies(rest: str, op: "re.Match[str]", started: tuple[Direction, int, int, int],
                      kernels: int, runs: int, in_branch: bool, where: tuple[str, int],
                      ) -> list["PlannedCopy"]:
    """A finished host call as copies: its device-memory operands to the host, its
    device-memory results (the `custom-call-done`'s shape) to the device."""
    _, to_host, before, start = started
    name = _OPERAND.findall(rest[op.end():])[0]
    to_device = _device_bytes(rest[: op.start()])
    between = kernels - before
    moved: tuple[tuple[Direction, int], ...] = (("to_host", to_host), ("to_device", to_device))
    return [PlannedCopy(direction, nbytes, between > 0, between, name, runs, in_branch,
                        where[0], start, where[1])
            for direction, nbytes in moved if nbytes]


def scheduled_collectives(hlo_text: str) -> tuple[PlannedCollective, ...]:
    """Every collective between devices in a scheduled HLO module (its synchronous
    form or the start of its asynchronous form), with its result's bytes and how many
    times the step runs it."""
    counts = run_counts(hlo_text)
    found: list[PlannedCollective] = []
    for computation, lines in computations(hlo_text).items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            op = _OPCODE.search(match.group("rest")) if match else None
            if match is None or op is None:
                continue
            kind = op.group("op").removesuffix("-start")
            if kind not in _COLLECTIVES or op.group("op").endswith("-done"):
                continue
            rest = match.group("rest")
            results = list(_ARRAY.finditer(rest[: op.start()]))
            # An asynchronous start's result is (operands, results[, context]).
            result = results[len(results) // 2] if op.group("op").endswith("-start") and len(
                results) > 1 else (results[0] if results else None)
            found.append(PlannedCollective(
                kind, _array_bytes(result) if result else 0, counts.get(computation, 1),
                match.group("name")))
    return tuple(found)


_COLLECTIVES = frozenset({"all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                          "collective-permute"})


def scheduled_copies(hlo_text: str) -> tuple[PlannedCopy, ...]:
    """Every `copy-start`/`copy-done` pair of a scheduled HLO module, and every
    asynchronous slice copy between host and device (`fusion-start`/`fusion-done` of a
    `dynamic-slice` or `dynamic-update-slice`), with whether a kernel runs between them
    (per computation, in its schedule order) and how many times the step runs it."""
    counts = run_counts(hlo_text)
    conditional = conditional_computations(hlo_text)
    in_branch = False
    copies: list[PlannedCopy] = []
    # name -> (direction, bytes, kernels so far, position of the start)
    open_copies: dict[str, tuple[Direction, int, int, int]] = {}
    kernels = 0
    runs = 1
    name_of, position = "", 0
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            open_copies.clear()  # a new computation
            kernels = 0
            computation = COMPUTATION.match(line)
            runs = counts.get(computation.group("name"), 1) if computation else 1
            in_branch = computation is not None and computation.group("name") in conditional
            name_of, position = (computation.group("name") if computation else ""), 0
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        position += 1
        rest = match.group("rest")
        op = _OPCODE.search(rest)
        if op is None:
            continue
        opcode = op.group("op")
        if opcode == "copy-start" and (moved := _host_copy(rest, op)) is not None:
            copy_direction, copy_bytes = moved
            open_copies[match.group("name")] = (copy_direction, copy_bytes, kernels, position)
        elif opcode in _SLICE_STARTS and (moved := _slice_copy(rest, op)) is not None:
            slice_direction, slice_bytes = moved
            open_copies[match.group("name")] = (slice_direction, slice_bytes, kernels, position)
        elif opcode == "custom-call-start" and _HOST_CALL in rest:
            kernels += 1  # the host's compute: what a copy beside it overlaps
            open_copies[match.group("name")] = ("to_host", _device_operand_bytes(rest), kernels,
                                                position)
        elif opcode == "custom-call-done" and (
                started := open_copies.pop((_OPERAND.findall(rest[op.end():]) or [""])[0], None)
        ) is not None:
            copies.extend(_host_call_copies(rest, op, started, kernels, runs, in_branch,
                                            (name_of, position)))
            kernels += 1
        elif opcode in _DONES and (
                started := open_copies.pop((_OPERAND.findall(rest[op.end():]) or [""])[0], None)
        ) is not None:
            direction, nbytes, before, start = started
            between = kernels - before
            name = _OPERAND.findall(rest[op.end():])[0]
            copies.append(PlannedCopy(direction, nbytes, between > 0, between, name, runs,
                                      in_branch, name_of, start, position))
        elif opcode not in _NOT_COMPUTE:
            kernels += 1
    return tuple(copies)
