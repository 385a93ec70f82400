"""How many times a step runs each computation of XLA's scheduled HLO module: the
computations of its text, which calls which, and each `while` loop's trip count. Pure
parsing, no JAX; `hlo` multiplies a copy's bytes by its computation's count.

XLA's GPU compiler writes a loop's trip count into its `backend_config`
(`"known_trip_count"`); XLA:TPU writes none, so the count is read from the loop itself:
its condition compares the counter (one element of the loop's tuple) with a constant,
the loop starts the counter at a constant and its body adds a constant to it (the form
`jax.lax.scan` and `fori_loop` lower to, also after XLA has unrolled a loop). A loop of
another form counts once (`unknown_loops` names it).
"""

import math
import re
from typing import Optional


COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)")
_INSTRUCTION = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)")
_WHILE = re.compile(r"\bcondition=%(?P<cond>[^\s,]+),\s*body=%(?P<body>[^\s,]+)")
_CALLED = re.compile(r"\b(?:condition|calls|to_apply|body|branch_computations|"
                     r"true_computation|false_computation|async_execution_thread)=\{?(?P<names>%[^\s,}]+(?:,\s*%[^\s,}]+)*)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>[0-9]+)"')
_INDEX = re.compile(r"\bindex=(?P<i>[0-9]+)")
_DIRECTION = re.compile(r"\bdirection=(?P<d>[A-Z]+)")
_BRANCHES = ("branch_computations", "true_computation", "false_computation")
# Instructions that pass a value on unchanged (for the counter and its constants).
_SAME_VALUE = frozenset({"copy", "bitcast", "convert", "reshape"})


def computations(hlo_text: str) -> dict[str, list[str]]:
    """The computations of an HLO module's text: name -> instruction lines."""
    found: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            match = COMPUTATION.match(line)
            current = found.setdefault(match.group("name") if match else line, [])
            continue
        if current is not None:
            current.append(line)
    return found


class _Instruction:
    """One instruction of the module: its opcode, operands and text, and whether it is
    its computation's root."""

    def __init__(self, root: bool, opcode: str, operands: list[str], rest: str) -> None:
        self.root, self.opcode, self.operands, self.rest = root, opcode, operands, rest


def _instructions(lines: list[str]) -> dict[str, _Instruction]:
    found: dict[str, _Instruction] = {}
    for line in lines:
        match = _INSTRUCTION.match(line)
        op = _OPCODE.search(match.group("rest")) if match else None
        if match is None or op is None:
            continue
        operands = [a.strip().lstrip("%") for a in op.group("args").split(",") if a.strip()]
        found[match.group("name")] = _Instruction(bool(match.group("root")), op.group("op"),
                                                  operands, match.group("rest"))
    return found


class _Module:
    """The instructions of every computation, for following a loop's counter."""

    def __init__(self, hlo_text: str) -> None:
        self.computations = computations(hlo_text)
        self.by_computation = {name: _instructions(lines)
                               for name, lines in self.computations.items()}
        self.all = {k: v for found in self.by_computation.values() for k, v in found.items()}

    def source(self, name: str) -> Optional[_Instruction]:
        """The instruction that makes `name`'s value, through copies and bitcasts."""
        seen = 0
        found = self.all.get(name)
        while found is not None and found.opcode in _SAME_VALUE and found.operands and seen < 16:
            found, seen = self.all.get(found.operands[0]), seen + 1
        return found

    def constant(self, name: str) -> Optional[int]:
        found = self.source(name)
        if found is None or found.opcode != "constant":
            return None
        try:
            return int(found.rest[found.rest.index("constant(") + 9:].split(")")[0])
        except ValueError:
            return None

    def counter_index(self, name: str) -> Optional[int]:
        """The tuple index `name` reads, if it is an element of a loop's parameter."""
        found = self.source(name)
        index = _INDEX.search(found.rest) if found and found.opcode == "get-tuple-element" else None
        return int(index.group("i")) if index else None

    def root(self, computation: str) -> Optional[_Instruction]:
        return next((i for i in self.by_computation.get(computation, {}).values() if i.root),
                    None)


# `counter DIRECTION limit` runs while true: the trips from `start` by `step`.
def _trips(direction: str, start: int, limit: int, step: int) -> Optional[int]:
    if direction not in ("LT", "LE", "GT", "GE"):
        return None
    if direction in ("GT", "GE"):
        start, limit, step = -start, -limit, -step
    if step <= 0:
        return None
    inclusive = 1 if direction in ("LE", "GE") else 0
    return max(0, math.ceil((limit + inclusive - start) / step))


def trip_count(module: "_Module", operands: list[str], rest: str) -> Optional[int]:
    """A `while` instruction's trip count: from its `backend_config`, or from its
    condition, its initial tuple and its body (see the module's docstring); `None`
    where neither says."""
    known = _TRIP_COUNT.search(rest)
    if known:
        return int(known.group("n"))
    loop = _WHILE.search(rest)
    compare = module.root(loop.group("cond")) if loop else None
    if loop is None or compare is None or compare.opcode != "compare" or len(
            compare.operands) != 2 or not operands:
        return None
    found = _DIRECTION.search(compare.rest)
    direction = found.group("d") if found else ""
    left, right = compare.operands
    if module.counter_index(left) is None:  # `limit > counter`: the mirror image
        left, right = right, left
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    index, limit = module.counter_index(left), module.constant(right)
    initial, body_root = module.source(operands[0]), module.root(loop.group("body"))
    if index is None or limit is None or initial is None or initial.opcode != "tuple" or (
            body_root is None or body_root.opcode != "tuple"):
        return None
    start = module.constant(initial.operands[index])
    update = module.source(body_root.operands[index])
    if start is None or update is None or update.opcode not in ("add", "subtract"):
        return None
    steps = [module.constant(a) for a in update.operands]
    step = next((s for s in steps if s is not None), None)
    if step is None:
        return None
    return _trips(direction, start, limit, -step if update.opcode == "subtract" else step)


def _called(module: "_Module") -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    """Per computation, the computations it calls with how many times per run (a loop
    body: its trip count), and the loops whose count is unknown."""
    called: dict[str, list[tuple[str, int]]] = {}
    unknown: list[str] = []
    for name, found in module.by_computation.items():
        for instruction_name, instruction in found.items():
            loop = _WHILE.search(instruction.rest) if instruction.opcode == "while" else None
            trips = trip_count(module, instruction.operands, instruction.rest) if loop else None
            if loop and trips is None:
                unknown.append(instruction_name)
            for match in _CALLED.finditer(instruction.rest):
                for callee in match.group("names").split(","):
                    callee = callee.strip().lstrip("%")
                    body = loop is not None and callee == loop.group("body")
                    called.setdefault(name, []).append(
                        (callee, trips if body and trips is not None else 1))
    return called, unknown


def run_counts(hlo_text: str) -> dict[str, int]:
    """How many times a step runs each computation of its scheduled HLO: 1 for the
    entry, the trip count of the loop (`trip_count`) times its caller's for a loop
    body, the caller's for anything else it calls."""
    module = _Module(hlo_text)
    called, _ = _called(module)
    callers = {c for calls in called.values() for c, _ in calls}
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for callee, trips in called.get(name, []):
            visit(callee, times * trips)

    for root in [n for n in module.computations if n not in callers]:
        visit(root, 1)
    return counts


def unknown_loops(hlo_text: str) -> tuple[str, ...]:
    """The `while` instructions whose trip count neither XLA's `backend_config` nor
    their form gives (each counted as one trip)."""
    return tuple(_called(_Module(hlo_text))[1])


def conditional_computations(hlo_text: str) -> frozenset[str]:
    """The computations of an HLO module that run only when a conditional takes a
    branch: its branches and everything they call."""
    calls: dict[str, list[tuple[str, bool]]] = {}
    for name, lines in computations(hlo_text).items():
        for line in lines:
            for match in _CALLED.finditer(line):
                branch = match.group(0).startswith(_BRANCHES)
                calls.setdefault(name, []).extend(
                    (callee.strip().lstrip("%"), branch)
                    for callee in match.group("names").split(","))
    found: set[str] = set()
    pending = [callee for callees in calls.values() for callee, branch in callees if branch]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending.extend(callee for callee, _ in calls.get(name, []))
    return frozenset(found)
