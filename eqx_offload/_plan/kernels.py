"""The device work of a step in XLA:TPU's schedule: each instruction's `estimated_cycles`
(XLA:TPU's own cost model, written on the instructions of its optimized program) and
each `while` loop, at their positions in their computation's schedule. Pure parsing, no
JAX; `timing` replays them beside the copies of `hlo.scheduled_copies` (the positions
count the same instructions)."""

import dataclasses
import re

from .loops import _BRANCHES, _CALLED, _INSTRUCTION, _Module, _WHILE, computations, trip_count


_CYCLES = re.compile(r'"estimated_cycles":"?(?P<n>[0-9]+)')


@dataclasses.dataclass(frozen=True)
class PlannedKernel:
    """One piece of device work in XLA's schedule.

    **Fields:** `computation` (the HLO computation it is scheduled in), `position` (its
    place in that computation's schedule, as `PlannedCopy.start`), `cycles` (XLA:TPU's
    `estimated_cycles` for it; 0 for a loop or a conditional), `calls` (the
    computations it runs: a `while` loop's body, run `trips` times, or a conditional's
    branches, of which the costliest is counted)."""

    computation: str
    position: int
    cycles: int
    calls: tuple[str, ...] = ()
    trips: int = 1


def scheduled_kernels(hlo_text: str) -> tuple[PlannedKernel, ...]:
    """The instructions of a scheduled HLO module that carry XLA:TPU's
    `estimated_cycles`, its `while` loops (a loop of unknown trip count runs once) and
    its conditionals; none for a module without estimates (XLA's GPU compiler writes
    none)."""
    if _CYCLES.search(hlo_text) is None:
        return ()
    module = _Module(hlo_text)
    found: list[PlannedKernel] = []
    for name, lines in computations(hlo_text).items():
        position = 0
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            position += 1
            instruction = module.by_computation[name].get(match.group("name"))
            opcode = instruction.opcode if instruction else ""
            loop = _WHILE.search(line) if opcode == "while" else None
            if loop is not None and instruction is not None:
                trips = trip_count(module, instruction.operands, instruction.rest)
                found.append(PlannedKernel(name, position, 0, (loop.group("body"),), trips or 1))
            elif opcode == "conditional":
                branches = tuple(callee.strip().lstrip("%") for m in _CALLED.finditer(line)
                                 if m.group(0).startswith(_BRANCHES)
                                 for callee in m.group("names").split(","))
                found.append(PlannedKernel(name, position, 0, branches))
            elif (cycles := _CYCLES.search(line)) is not None:
                found.append(PlannedKernel(name, position, int(cycles.group("n"))))
    return tuple(found)
