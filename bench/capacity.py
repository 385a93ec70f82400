"""What fits, and what it costs: the largest Llama-style model whose whole AdamW training
step fits one GPU (or an 8-GPU node), for each way of offloading, planned from shapes.

`python bench/capacity_run.py` builds every step abstractly
(`eqx_offload.checkpoint.filter_eval_shape`: no array of the model or its state is allocated),
compiles it for the target with `eqx_offload.planner.gpu_plan` (XLA's GPU compiler, run
without a GPU) and searches the size ladder (`llama.ladder()`: the published Llama
shapes from 1B to 70B and depths between them) for the largest member whose step fits
both the device's memory and the host memory given. Every device and host number is
XLA's plan (its buffer assignment for the target), not a measurement; the floors are
lower bounds computed from the plan (see `Plan.compute_floor_seconds`), not
predictions of the step time.
"""

import dataclasses
import json
import os
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_offload
from eqx_offload.planner import TPU_TARGETS

from harness import builder, Mode, model_of, optimizer_of, Spec
from llama import llama_loss, LlamaShape


GB = 10**9


def fsdp_spec(shape: tuple[int, ...], n: int, stacked: bool, axis: str = "data") -> Any:
    """The `PartitionSpec` that shards a weight over `n` devices, FSDP style: its
    largest axis that `n` divides (never a stack's layer axis, which the scan slices),
    or replicated."""
    spec: list[Optional[str]] = [None] * len(shape)
    choices = [i for i in range(1 if stacked else 0, len(shape)) if shape[i] % n == 0]
    if choices:
        spec[max(choices, key=lambda i: shape[i])] = axis
    return jax.sharding.PartitionSpec(*spec)


def shard_abstract(model: Any, mesh: Optional[jax.sharding.Mesh]) -> Any:
    """An abstract model (of `jax.ShapeDtypeStruct`s) sharded FSDP style over `mesh`'s
    one axis, each leaf in its own memory kind; unchanged without a mesh."""
    if mesh is None:
        return model
    n = mesh.devices.size
    axis = mesh.axis_names[0]

    def shard(path: Any, x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        stacked = any(getattr(k, "name", None) == "blocks" for k in path)
        sharding = jax.sharding.NamedSharding(
            mesh, fsdp_spec(x.shape, n, stacked, axis), memory_kind=x.sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(shard, model, is_leaf=_is_abstract)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _one_step(update: Callable[..., Any]) -> Callable[..., Any]:
    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        return update(model, state, eqx.filter_grad(llama_loss)(model, tokens))
    return step


def training_update(shape: LlamaShape, mode: Mode,
                    mesh: Optional[jax.sharding.Mesh] = None
                    ) -> tuple[Callable[..., Any], Any, Any]:
    """`(update, model, state)`: `update(model, state, grads) -> (model, state)`, the
    AdamW update of a `Llama` of `shape` in `mode` (`harness.builder`), and its abstract
    arguments (`jax.ShapeDtypeStruct`s with shardings that carry memory kinds; over
    `mesh`, one axis, sharded FSDP style). Nothing is allocated."""
    model = shard_abstract(eqx_offload.checkpoint.filter_eval_shape(
        model_of, shape, Spec(mode), jax.random.key(0)), mesh)
    init, update = builder(Spec(mode), optimizer_of(Spec(mode)))
    model, state = eqx_offload.checkpoint.filter_eval_shape(init, model)
    return update, model, state


def abstract_tokens(shape: LlamaShape, mesh: Optional[jax.sharding.Mesh],
                    micro_batches: Optional[int] = None) -> jax.ShapeDtypeStruct:
    """The abstract token ids of a step: `(shape.batch * devices, seq + 1)`, split over
    `mesh`'s devices, with a leading axis of `micro_batches` where given."""
    n = 1 if mesh is None else mesh.devices.size
    lead: tuple[int, ...] = () if micro_batches is None else (micro_batches,)
    if mesh is None:
        sharding: Any = jax.sharding.make_single_device_sharding(jax.devices()[0])
    else:
        sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*(None,) * len(lead), mesh.axis_names[0]))
    return jax.ShapeDtypeStruct(lead + (shape.batch * n, shape.seq + 1), jnp.int32,
                                sharding=sharding)


def training_step(shape: LlamaShape, mode: Mode,
                  mesh: Optional[jax.sharding.Mesh] = None) -> tuple[Any, tuple[Any, ...]]:
    """`(step, (model, state, tokens))` for one AdamW training step of a `Llama` of
    `shape` in `mode`, every argument abstract (`jax.ShapeDtypeStruct`s with
    shardings that carry memory kinds); over `mesh` (one axis), the weights and the
    state sharded FSDP style and the batch (`shape.batch` sequences per device)
    split over the devices. Nothing is allocated."""
    update, model, state = training_update(shape, mode, mesh)
    return _one_step(update), (model, state, abstract_tokens(shape, mesh))


@dataclasses.dataclass(frozen=True)
class CapacityPoint:
    """One planned step: a shape in a mode on a target. XLA's plan, not a measurement.

    **Fields:** `shape`, `mode`, `target`, `n_devices`; `device_peak_bytes` (per
    device), `device_memory_bytes`; `host_bytes` (all devices of the process),
    `host_memory_bytes` (given), `host_pool_bytes` (the pinned pool XLA allows by
    default); `fits` (device peak and host bytes both within their memories);
    `bytes_to_device`, `bytes_to_host` (per device, every execution of every copy);
    `collectives` (kind -> (count, bytes) per device); `compute_floor_s`,
    `transfer_floor_s`, `floor_ratio` (lower bounds, see `Plan`); `error` (XLA's,
    where it could not compile); `plan_s` (seconds to trace and compile);
    `from_arguments` (not compiled: the step's arguments alone, the weights and the
    state, exceed the device's or the host's memory, so no plan of it can fit; the
    byte counts are then those of the arguments, lower bounds of the plan's);
    `run_settings` (the environment a run of the step needs beyond JAX's defaults,
    `Plan.run_settings()`: what `fits` assumes).
    """

    shape: LlamaShape
    mode: str
    target: str
    n_devices: int
    device_peak_bytes: int
    device_memory_bytes: int
    host_bytes: int
    host_memory_bytes: int
    host_pool_bytes: int
    fits: bool
    bytes_to_device: int
    bytes_to_host: int
    collectives: dict[str, tuple[int, int]]
    compute_floor_s: float
    transfer_floor_s: float
    floor_ratio: float
    error: Optional[str]
    plan_s: float
    from_arguments: bool = False
    run_settings: tuple[str, ...] = ()

    @property
    def params(self) -> int:
        return self.shape.params


HOST_KINDS: tuple[str, ...] = typing.get_args(eqx_offload.types.HostMemoryKind)


def write_outputs(markdown: Optional[str], json_path: Optional[str], table: str,
                  records: list[Any]) -> None:
    """`--markdown` and `--json` of the capacity commands: the table and the records,
    each where asked."""
    if markdown:
        with open(markdown, "w") as f:
            f.write(table + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)


def size_text(n: Union[int, float]) -> str:
    """Bytes as GiB, or as MiB below one GiB (a small model's plan would read 0.0 GiB)."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def over_limits(p: Any) -> list[str]:
    """Why a planned point (`CapacityPoint` or `BatchPoint`) does not fit: its device
    peak above the device memory, its host bytes above the host memory given."""
    reasons = []
    if p.device_peak_bytes > p.device_memory_bytes:
        reasons.append(f"device peak {size_text(p.device_peak_bytes)} > "
                       f"{size_text(p.device_memory_bytes)}")
    if p.host_bytes > p.host_memory_bytes:
        reasons.append(f"host {size_text(p.host_bytes)} > {size_text(p.host_memory_bytes)}")
    return reasons


def plan_fits(plan: eqx_offload.planner.Plan, host_memory: int) -> bool:
    """Whether a planned step fits a run set up as `plan.run_settings()` says: its
    device peak within the device's memory (a memory fraction up to the whole device
    is one setting away; `Plan.fits` judges the fraction JAX allocates now), its
    host bytes within `host_memory` (the pinned pool is raised by the other)."""
    return (plan.device_peak_bytes <= plan.device_memory_size
            and plan.host_total_bytes <= host_memory)


def argument_bytes(args: Any) -> tuple[int, int]:
    """`(device, host)`: the bytes the abstract arguments hold on one device (the
    largest per-device total of their shards) and in host memory (all devices)."""
    device: dict[Any, int] = {}
    host = 0
    for x in jax.tree.leaves(args):
        if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
            continue
        shard = int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        devices = x.sharding.device_set
        if x.sharding.memory_kind in HOST_KINDS:
            host += shard * len(devices)
        else:
            for d in devices:
                device[d] = device.get(d, 0) + shard
    return max(device.values(), default=0), host


def plan_point(shape: LlamaShape, mode: Mode, target: str = "h100",
               host_memory: int = 256 * GB, mesh: Optional[jax.sharding.Mesh] = None,
               device_memory: Optional[int] = None) -> CapacityPoint:
    """Plan one step (see `training_step`) and say whether it fits."""
    start = time.perf_counter()
    n = 1 if mesh is None else mesh.devices.size
    chip = {**eqx_offload.planner.GPU_TARGETS, **TPU_TARGETS}[target]
    memory = chip.device_memory_size if device_memory is None else device_memory
    step, args = training_step(shape, mode, mesh)
    device_args, host_args = argument_bytes(args)
    if device_args > memory or host_args > host_memory:
        # The arguments outlive no step: a plan's device peak and host bytes are at least
        # theirs. Compiling it (minutes for the largest models, most of it XLA's
        # rematerialization trying) would only say so again.
        return CapacityPoint(shape, mode.name, target, n, device_args, memory, host_args,
                             host_memory, 0, False, 0, 0, {}, 0.0, 0.0, 0.0, None,
                             time.perf_counter() - start, from_arguments=True)
    try:
        plan = eqx_offload.plan(step, *args, target=target, device_memory=device_memory,
                                host_memory=host_memory)
    except eqx_offload.errors.PlanError as error:
        return CapacityPoint(shape, mode.name, target, n, 0, memory, 0, host_memory, 0, False,
                             0, 0, {}, 0.0, 0.0, 0.0, str(error)[:500],
                             time.perf_counter() - start)
    collectives: dict[str, tuple[int, int]] = {}
    for c in plan.collectives:
        count, nbytes = collectives.get(c.kind, (0, 0))
        collectives[c.kind] = (count + c.count, nbytes + c.nbytes * c.count)
    return CapacityPoint(
        shape, mode.name, target, n, plan.device_peak_bytes, plan.device_memory_size,
        plan.host_total_bytes, host_memory, plan.host_limit_bytes, plan_fits(plan, host_memory),
        plan.bytes_moved("to_device"), plan.bytes_moved("to_host"), collectives,
        plan.compute_floor_seconds, plan.transfer_floor_seconds, plan.floor_ratio, None,
        time.perf_counter() - start, run_settings=tuple(plan.run_settings()))


_S = TypeVar("_S")


def largest_fitting(shapes: Sequence[_S], fits: Callable[[_S], bool],
                    start: Union[None, int, Sequence[int]] = None
                    ) -> tuple[Optional[int], dict[int, bool]]:
    """The index of the largest of `shapes` (sorted by size) for which `fits`, found by
    bisection (a larger model of the ladder never fits where a smaller one does not:
    its weights, state and activations are each at least as large), and every answer
    asked for (index -> fits). `start`, if given, is a guess or several (the answers
    of modes that keep more on the device, or of a smaller GPU), asked first from the
    largest down until one fits; the bisection then runs between the largest that
    fits and the smallest that does not, so a wrong guess costs one question."""
    asked: dict[int, bool] = {}

    def ask(i: int) -> bool:
        if i not in asked:
            asked[i] = fits(shapes[i])
        return asked[i]

    low, high = -1, len(shapes)  # shapes[low] fits (or none), shapes[high] does not
    starts = [start] if isinstance(start, int) else list(start or ())
    for guess in sorted({g for g in starts if 0 <= g < len(shapes)}, reverse=True):
        if ask(guess):
            low = guess
            break
        high = guess
    while high - low > 1:
        middle = (low + high) // 2
        if ask(middle):
            low = middle
        else:
            high = middle
    return (low if low >= 0 else None), asked


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The answer for one mode on one target: the largest member of the ladder whose
    step fits (`None` if not even the smallest does), and every point planned on the
    way (the bisection's questions and their answers)."""

    mode: Mode
    target: str
    n_devices: int
    largest: Optional[CapacityPoint]
    first_too_large: Optional[CapacityPoint]
    planned: tuple[CapacityPoint, ...]


def capacity(shapes: Sequence[LlamaShape], mode: Mode, target: str,
             host_memory: int, mesh: Optional[jax.sharding.Mesh] = None,
             device_memory: Optional[int] = None,
             progress: Optional[Callable[[CapacityPoint], None]] = None,
             start: Union[None, int, Sequence[int]] = None,
             cache: Optional["PointCache"] = None) -> Capacity:
    """The largest of `shapes` (sorted by size) that trains in `mode` on `target` (over
    `mesh`'s devices, if given) within `host_memory` bytes of host memory (for all the
    devices), by bisection (`largest_fitting`, from the guesses `start`). Points found
    in `cache` are not planned again; those planned are added to it."""
    points: dict[int, CapacityPoint] = {}
    n = 1 if mesh is None else mesh.devices.size

    def fits(shape: LlamaShape) -> bool:
        point = None if cache is None else cache.get(shape, mode.name, target, n, host_memory,
                                                     device_memory)
        if point is None:
            point = plan_point(shape, mode, target, host_memory, mesh, device_memory)
            if cache is not None:
                cache.add(point, device_memory)
        points[shapes.index(shape)] = point
        if progress is not None:
            progress(point)
        return point.fits

    index, _ = largest_fitting(shapes, fits, start)
    above = min((i for i in points if index is None or i > index), default=None)
    return Capacity(mode, target, n, None if index is None else points[index],
                    None if above is None else points[above],
                    tuple(points[i] for i in sorted(points)))


class PointCache:
    """Planned points kept in a JSON-lines file (`--cache`), one line per point as it
    is planned, so that a long `--capacity` run that stops (or is run again with more
    GPUs or modes) plans nothing twice. A point is found again by its shape, mode,
    target, device count, host memory and device memory."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._points: dict[tuple[Any, ...], CapacityPoint] = {}
        if path is not None and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        if "run_settings" not in record:  # planned by an older version
                            continue
                        point = point_from_record(record)
                        self._points[self._key(point.shape, point.mode, point.target,
                                               point.n_devices, point.host_memory_bytes,
                                               record.get("device_memory"))] = point

    @staticmethod
    def _key(shape: LlamaShape, mode: str, target: str, n: int, host_memory: int,
             device_memory: Optional[int]) -> tuple[Any, ...]:
        return (dataclasses.astuple(shape), mode, target, n, host_memory, device_memory)

    def get(self, shape: LlamaShape, mode: str, target: str, n: int, host_memory: int,
            device_memory: Optional[int]) -> Optional[CapacityPoint]:
        return self._points.get(self._key(shape, mode, target, n, host_memory, device_memory))

    def add(self, point: CapacityPoint, device_memory: Optional[int]) -> None:
        self._points[self._key(point.shape, point.mode, point.target, point.n_devices,
                               point.host_memory_bytes, device_memory)] = point
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(point_record(point), device_memory=device_memory)) + "\n")



def point_record(p: CapacityPoint) -> dict[str, Any]:
    """A `CapacityPoint` as plain data (JSON)."""
    record = dataclasses.asdict(p)
    record["params"] = p.params
    return record


def point_from_record(record: dict[str, Any]) -> CapacityPoint:
    """The `CapacityPoint` that `point_record` wrote."""
    fields = {f.name for f in dataclasses.fields(CapacityPoint)}
    values: dict[str, Any] = {k: v for k, v in record.items() if k in fields}
    values["shape"] = LlamaShape(**record["shape"])
    collectives: dict[str, Any] = record["collectives"]
    values["collectives"] = {k: (int(c), int(b)) for k, (c, b) in collectives.items()}
    values["run_settings"] = tuple(record["run_settings"])
    return CapacityPoint(**values)


def settings_text(settings: Sequence[str]) -> str:
    """The settings as a table cell: `` `A=1 B=2` ``, or "defaults" where none is
    needed."""
    return f"`{' '.join(settings)}`" if settings else "defaults"
