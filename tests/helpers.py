"""The test suite's one vocabulary: bitwise comparison (`assert_tree_equal`, `tree_bits`,
`hex_bits` for JSON out of a subprocess), parameters and gradients (`committed`,
`make_params`, `make_grads`), where leaves live (`assert_placed`, `memory_kinds`,
`kind_list`, `unwrap`), `unchecked`, `count_compiles`, `walk_eqns`, a scanned `Stacked`
model, `gpu_plan_marks`, a TPU v5e (`v5e`), MultiSteps' updates and a donated training step; and the
cases several test files share (optax compositions, stacked layers, the multi-process
worker's model, a ported run against the original)."""

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from mp_worker import initial_values, SPECS

import eqx_offload
from eqx_offload import OffloadedState
from eqx_offload._core.leaves import path_to_str
from jax.extend.core import jaxprs_in_params


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _bits(x: Any) -> bytes:
    """The raw bytes of an array (read on the host); typed PRNG keys by their key data."""
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def tree_bits(tree: Any) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Path, dtype, shape and raw bytes of every array leaf: `==` of two is bitwise equality."""
    return [(jtu.keystr(p), str(x.dtype), tuple(x.shape), _bits(x))
            for p, x in jtu.tree_flatten_with_path(tree)[0] if _is_array(x)]


def hex_bits(tree: Any) -> list[str]:
    """`tree_bits`' raw bytes in hex: what JSON carries out of a subprocess."""
    return [raw.hex() for *_, raw in tree_bits(tree)]


def unchecked(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` without the pytest hook's jaxtyping/beartype wrapper (as a user calls it)."""
    return getattr(f, "__wrapped__", f)


def walk_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a jaxpr (a `Jaxpr` or `ClosedJaxpr`), at any depth."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from walk_eqns(sub)


def tree_difference(a: Any, b: Any) -> Optional[str]:
    """`None` if `a` and `b` are equal pytrees, else the first difference: the same structure
    (node types, static fields), array leaves (JAX or NumPy) of the same dtype, shape and
    bytes (NaN payloads and -0.0 count), other leaves of the same type and `==`."""
    leaves_a, def_a = jtu.tree_flatten_with_path(a)
    leaves_b, def_b = jtu.tree_flatten_with_path(b)
    if def_a != def_b:
        return f"structures differ: {def_a} != {def_b}"
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        where = path_to_str(path) or "<root>"
        if _is_array(x) != _is_array(y):
            return f"at {where}: {type(x).__name__} vs {type(y).__name__}"
        if _is_array(x):
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"at {where}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
            if _bits(x) != _bits(y):
                return f"at {where}: values differ bitwise: {x!r} vs {y!r}"
        elif type(x) is not type(y) or not (x is y or x == y):
            return f"at {where}: {x!r} vs {y!r}"
    return None


def tree_equal(a: Any, b: Any) -> bool:
    """Bitwise pytree equality (see `tree_difference`)."""
    return tree_difference(a, b) is None


def assert_tree_equal(a: Any, b: Any) -> None:
    """Asserts bitwise pytree equality, naming the first leaf that differs."""
    difference = tree_difference(a, b)
    assert difference is None, difference


def memory_kinds(tree: Any) -> dict[str, str]:
    """`{path: memory kind}` of every `jax.Array` leaf (`"<root>"` for a bare array)."""
    return {path_to_str(path) or "<root>": leaf.sharding.memory_kind
            for path, leaf in jtu.tree_flatten_with_path(tree)[0] if isinstance(leaf, jax.Array)}


def kind_list(tree: Any) -> list[str]:
    """The memory kind of every `jax.Array` leaf of `tree`, in leaf order."""
    return list(memory_kinds(tree).values())


def committed(x: Any, dtype: Any = np.float32) -> jax.Array:
    """`x` committed to the default device (an uncommitted first argument compiles twice)."""
    return jax.device_put(np.asarray(x, dtype), jax.devices()[0])


def make_params(*extras: str, seed: int = 0) -> dict[str, Any]:
    """Committed parameters: a (48, 16) `embed`, a `layer` of a (16, 8) `w` and an (8,)
    `b`, a 0-d `scale`. `extras`: `"complex"` adds a complex64 (2, 3) `c`, `"half"` a
    float16 (8,) `h`, `"no_scalar"` drops `scale`."""
    rng = np.random.default_rng(seed)
    params: dict[str, Any] = {
        "embed": committed(rng.standard_normal((48, 16))),
        "layer": {"w": committed(rng.standard_normal((16, 8))), "b": committed(rng.standard_normal(8))},
        "scale": committed(0.5),
    }
    if "complex" in extras:
        c = rng.standard_normal((2, 3)) - 2.5j * rng.standard_normal((2, 3))
        params["c"] = committed(c, np.complex64)
    if "half" in extras:
        params["h"] = committed(rng.standard_normal(8), np.float16)
    if "no_scalar" in extras:
        del params["scale"]
    return params


def make_grads(params: Any, step: int, nonfinite: bool = False) -> Any:
    """Gradients for step `step`, different at each step, in the parameters' dtypes;
    `nonfinite`: at step 1 the first entry of each leaf of more than 3 entries is inf."""
    def one(x: Any) -> Any:
        g = (x * (step + 1) + 0.25).astype(x.dtype)
        if nonfinite and step == 1 and x.size > 3:
            g = g.at[(0,) * x.ndim].set(jnp.inf)
        return g

    return jtu.tree_map(one, params)


def _path(path: Any) -> str:
    """A key path as the docs say a `Filter` sees it, independently of the package."""
    return "/".join(str(next(getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)))
                    for k in path)


def _selects(where: Any, leaf: Any, path: str) -> bool:
    if where is None:
        where = eqx_offload.min_ndim(1)
    if isinstance(where, bool):
        return where
    if isinstance(where, eqx_offload.types.Filter):
        return bool(where(leaf, path))
    return bool(where(leaf))


def assert_placed(tree: Any, where: Any = None, kind: str = "pinned_host") -> None:
    """Each array leaf inside an `OffloadedState` that `where` (default `min_ndim(1)`) selects
    is in `kind`, every other one on the device; never selected: `acc_grads` and `grad`."""
    def visit(tree: Any, inside: bool) -> None:
        is_state = lambda x: isinstance(x, OffloadedState)  # noqa: E731
        for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
            if is_state(leaf):
                visit(leaf.inner_state, True)
            elif isinstance(leaf, jax.Array):
                where_ = _path(path)
                kept = {"acc_grads", "grad"} & set(where_.split("/"))
                selected = inside and not kept and _selects(where, leaf, where_)
                want = kind if selected else "device"
                assert leaf.sharding.memory_kind == want, (where_, leaf.sharding)

    visit(tree, False)


def unwrap(tree: Any) -> Any:
    """`tree` with every `OffloadedState(x)` replaced by `x`."""
    return jtu.tree_map(lambda x: unwrap(x.inner_state) if isinstance(x, OffloadedState) else x,
                        tree, is_leaf=lambda x: isinstance(x, OffloadedState))


@contextlib.contextmanager
def count_compiles(fun_name: Optional[str] = None) -> Iterator[list[str]]:
    """The names of the XLA compilations inside the block (from `jax.monitoring`); with
    `fun_name`, only those of functions of that name."""
    names: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        name = str(kwargs.get("fun_name"))  # JAX (0.10) says "jit(f)" for a function f
        compiled = event == "/jax/core/compile/backend_compile_duration"
        if compiled and fun_name in (None, name, name[4:-1]):
            names.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


class Stacked(eqx.Module):
    """`depth` layers stacked with `eqx.filter_vmap` (one weight, one bias leaf), scanned."""

    layers: eqx.nn.Linear

    def __init__(self, width: int, depth: int, key: Any) -> None:
        make = lambda k: eqx.nn.Linear(width, width, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jax.random.split(key, depth))

    def __call__(self, x: Any) -> Any:
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(x: Any, weights: Any) -> tuple[Any, None]:
            return jnp.tanh(eqx.combine(weights, static)(x)), None

        return jax.lax.scan(layer, x, dynamic)[0]


# What libtpu needs to compile for a TPU v5e on a machine without one (tests/tpu/): the
# chip it describes, no metadata server to ask, and several processes at once
# (pytest-xdist's workers; without it the second fails on libtpu's lockfile).
TPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def _without_libtpu() -> Optional[str]:
    """Why a test that compiles through libtpu cannot run here, or `None` if it can."""
    if importlib.util.find_spec("libtpu") is not None:
        return None
    version = importlib.metadata.version("jax")
    return (f"libtpu for jax {version} is not installed (a JAX release can come before "
            f'its libtpu): `pip install "jax[tpu]=={version}"`; this test compiles for a '
            "TPU v5e without one.")


def tpu_plan_marks() -> list[Any]:
    """The marks of a test that compiles through libtpu: without libtpu, a skip naming the
    JAX version whose libtpu is missing and its install command."""
    reason = _without_libtpu()
    return [] if reason is None else [pytest.mark.skip(reason=reason)]


@functools.lru_cache(maxsize=None)
def v5e() -> Any:
    """The first device of a TPU v5e topology (2x2, of which a test uses one chip),
    compile-only, with the chip's memories; skips the test, naming the install, without
    libtpu (`tpu_plan_marks`). `TPU_ENV` is set for the plugin's start only, the
    process's own values back after it (another test's child process inherits nothing of
    it); the CPU stays JAX's default backend."""
    reason = _without_libtpu()
    if reason is not None:
        pytest.skip(reason)
    from jax.experimental import topologies

    saved = {k: os.environ.get(k) for k in TPU_ENV}
    os.environ.update(TPU_ENV)
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return topology.devices[0]


def gpu_plan_marks() -> list[Any]:
    """The marks of a GPU-plan test: `once` (the plugin is in the newest environment only)
    and, where jax-cuda12-plugin is not installed, a skip naming the JAX version whose
    plugin is missing and its install command. An installed plugin of another version
    does not skip: the test fails with the mismatch."""
    try:
        importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("jax")
        reason = (f"jax-cuda12-plugin {version} (for jax {version}) is not installed (a JAX "
                  "release can come before its GPU plugin): "
                  f"`pip install 'jax-cuda12-plugin=={version}' nvidia-cuda-nvcc-cu12`.")
        return [pytest.mark.once, pytest.mark.skip(reason=reason)]
    return [pytest.mark.once]


def assert_multi_steps_updates(expected: Any, got: Any, applied: Optional[bool] = None) -> None:
    """`offloaded(MultiSteps)`'s updates against `MultiSteps`': bitwise on a mini-step that
    applies (`applied=None`: either), else `+0.0` where `MultiSteps` gives `0 * u` for the
    update `u` it discards (`±0.0`, NaN where `u` is not finite)."""
    if applied or (applied is None and tree_equal(expected, got)):
        return assert_tree_equal(expected, got)
    assert jtu.tree_structure(expected) == jtu.tree_structure(got)
    for a, b in zip(jtu.tree_leaves(expected), jtu.tree_leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert np.all(b == 0) and not np.signbit(b).any(), b  # +0.0 everywhere
        assert np.all((a == 0) | np.isnan(a)), a  # MultiSteps' 0 * u


def donated_step(optimizer: Any, model: Any, x: Any) -> tuple[Any, tuple[Any, Any, Any]]:
    """A donated training step of `model` under `optimizer` (mean square of its outputs
    on `x`), and its arguments `(model, state, x)`."""
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, x: Any) -> tuple[Any, Any]:
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return step, (model, state, x)


# The compositions of `offloaded` with optax combinators (test_equivalence, test_optax).
LR = 0.1


def scale_by_arg() -> optax.GradientTransformationExtraArgs:
    def update(updates: Any, state: Any, params: Any = None, *, factor: Any) -> Any:
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def multi_steps(inner: Any) -> optax.GradientTransformation:
    return optax.MultiSteps(inner, every_k_schedule=2).gradient_transformation()


Make = Callable[[Callable[[Any], Any]], optax.GradientTransformation]
LABELS = {"embed": "a", "layer": {"w": "a", "b": "b"}, "scale": "b"}
MASK = {"embed": True, "layer": {"w": False, "b": True}, "scale": True}
COMPOSITIONS: dict[str, Make] = {
    # `offloaded` outermost (the recommended order)
    "offloaded(MultiSteps(adamw))": lambda w: w(multi_steps(optax.adamw(LR))),
    "offloaded(apply_if_finite(adamw))": lambda w: w(optax.apply_if_finite(optax.adamw(LR), 3)),
    "offloaded(inject_hyperparams(adamw))": lambda w: w(
        optax.inject_hyperparams(optax.adamw)(learning_rate=LR)),
    "offloaded(masked(adam))": lambda w: w(optax.masked(optax.adam(LR), MASK)),
    "offloaded(multi_transform)": lambda w: w(optax.multi_transform(
        {"a": optax.adam(LR), "b": optax.sgd(LR, momentum=0.9)}, LABELS)),
    "offloaded(chain(clip, adamw))": lambda w: w(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))),
    "offloaded(schedule_free(adam))": lambda w: w(
        optax.contrib.schedule_free(optax.adam(LR, b1=0.0), LR)),
    # `offloaded` inside a combinator that only routes the state
    "chain(clip, offloaded(adamw))": lambda w: optax.chain(
        optax.clip_by_global_norm(1.0), w(optax.adamw(LR))),
    "chain(offloaded(adam), offloaded(trace))": lambda w: optax.chain(
        w(optax.scale_by_adam()), w(optax.trace(0.9)), optax.scale(-LR)),
    "inject_hyperparams(offloaded(adamw))": lambda w: optax.inject_hyperparams(
        lambda learning_rate: w(optax.adamw(learning_rate)))(learning_rate=LR),
    "masked(offloaded(adam))": lambda w: optax.masked(w(optax.adam(LR)), MASK),
    "multi_transform(offloaded(adam), sgd)": lambda w: optax.multi_transform(
        {"a": w(optax.adam(LR)), "b": optax.sgd(LR, momentum=0.9)}, LABELS),
    "schedule_free(offloaded(adam))": lambda w: optax.contrib.schedule_free(
        w(optax.adam(LR, b1=0.0)), LR),
    "apply_if_finite(offloaded(adamw))": lambda w: optax.apply_if_finite(w(optax.adamw(LR)), 3),
    # computes on the state it wraps (`jnp.where`): runs on the CPU; test_optax.py
    # has `filter_jit` reject it
    "MultiSteps(offloaded(adamw))": lambda w: multi_steps(w(optax.adamw(LR))),
}


# Updates the streamed strategy cannot stream (test_schedule, test_stream).
REJECTED_STREAMING: dict[str, Callable[[], Any]] = {
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "clip_after_adam": lambda: optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0)),
}


# Stacked layers for `scan_layers` (test_scan, test_jit).
SCAN_DEPTH, SCAN_WIDTH = 4, 16


def make_layers(seed: int = 0) -> eqx.nn.Linear:
    keys = jax.random.split(jax.random.key(seed), SCAN_DEPTH)
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(SCAN_WIDTH, SCAN_WIDTH, key=k))(keys)


def tanh_layer(layer: Any, x: jax.Array) -> jax.Array:
    return jnp.tanh(layer(x))


def scan_loss(layers: Any, x: jax.Array, offload_input: bool = False,
              prefetch: bool = True) -> jax.Array:
    return jnp.sum(eqx_offload.scan_layers(layers, x, tanh_layer, offload_input=offload_input,
                                           prefetch=prefetch) ** 2)


# The multi-process worker's model and training loop in one process (test_checkpoint,
# test_jit).
def worker_params(mesh: Optional[jax.sharding.Mesh] = None) -> dict[str, jax.Array]:
    params = {k: jnp.asarray(v) for k, v in initial_values()[0].items()}
    return params if mesh is None else {
        k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def worker_opt() -> optax.GradientTransformation:
    return eqx_offload.offloaded(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))


def worker_train(params: Any, state: Any, step: Any, steps: range,
          mesh: Optional[jax.sharding.Mesh] = None) -> tuple[Any, Any, list[jax.Array]]:
    """Steps `steps` of a fixed stream of batches (split over `data` on a mesh)."""
    rng = np.random.default_rng(1)
    data = [rng.standard_normal((2, 8, 8), np.float32) for _ in range(max(steps) + 1)]
    where = jax.devices()[0] if mesh is None else NamedSharding(mesh, P("data", None))
    losses = []
    for i in steps:
        params, state, value = step(params, state, *jax.device_put(list(data[i]), where))
        losses.append(value)
    return params, state, losses


def host_typed(x: jax.Array) -> bool:
    """JAX's type of `x` says host memory (what `jax.jit` traces it as)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def offloaded_leaves(state: Any) -> list[jax.Array]:
    return [x for x in jtu.tree_leaves(state) if x.ndim >= 1]


# A ported program against the program as written (test_ports, test_programs, test_donation).
def assert_same_run(plain: Any, ported: Any) -> None:
    """Bitwise equal losses, model, inner state and extras of two `ports.common.Run`s; the
    ported state in host memory after every step; no compilation after the first ported
    step."""
    from ports.common import expected_placement  # (it imports this module)

    assert len(plain.losses) == len(ported.losses) >= 4
    assert len({np.asarray(x).tobytes() for x in plain.losses}) > 1, "it does not train"
    assert_tree_equal((plain.losses, plain.model, plain.opt_state, plain.extra),
                      (ported.losses, ported.model, unwrap(ported.opt_state), ported.extra))
    expected = expected_placement(ported.opt_state)
    assert "pinned_host" in expected.values()
    assert not plain.placements and ported.placements == [expected] * len(ported.losses)
    # (The plain run may compile twice: its `init` returns uncommitted arrays, upstream.)
    assert ported.compiles[1:] == [0] * (len(ported.compiles) - 1), ported.compiles


def host_layer_stack(n: int, d: int) -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
    """`n` stacked `d`x`d` linear layers in host memory, and a forward pass over them by
    `scan_layers` without prefetch (one layer fetched a loop trip)."""
    import eqx_offload

    keys = jax.random.split(jax.random.key(0), n)
    layers = eqx_offload.to_host(eqx.filter_vmap(
        lambda k: eqx.nn.Linear(d, d, use_bias=False, key=k))(keys))

    def forward(layers: Any, x: jax.Array) -> jax.Array:
        return eqx_offload.scan_layers(layers, x, lambda layer, h: jnp.tanh(jax.vmap(layer)(h)),
                                       prefetch=False)

    return layers, forward
