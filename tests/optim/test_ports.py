"""Programs ported with the README's three-line change (tests/ports/), bitwise equal to
the programs as written, and the optax idioms they use: reading and writing a state,
states holding Python scalars or changing structure, extra `update` arguments."""

import contextlib
import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import assert_tree_equal, count_compiles, unwrap
from helpers import assert_same_run
from isolated import call_isolated
from ports import batchnorm, data_parallel, frozen, linen_trainstate, nonarray, rnn
from ports.common import expected_placement, placement, Recorder, Run

import eqx_offload


def _difference(plain: Run, ported: Run) -> Optional[str]:
    """`assert_same_run`'s error (its start), or None."""
    try:
        assert_same_run(plain, ported)
    except AssertionError as error:
        return str(error)[:2000]
    return None


def test_compilations_are_counted() -> None:
    """The counter behind `Run.compiles` sees a compilation (the checks can fail)."""
    x = jnp.arange(5.0)
    with count_compiles() as compiled:
        jax.jit(lambda x: x * 3 + 1)(x)
    assert len(compiled) == 1


# ----------------------------------------------------------------------------- programs

PROGRAMS: dict[str, Callable[..., Run]] = {
    "rnn_scan": rnn.train,
    "batchnorm_state": batchnorm.train,
    "frozen_partition": frozen.train_partition,
    "frozen_multi_transform": frozen.train_multi_transform,
    "non_array_leaves": nonarray.train,
    "data_parallel_device_put": functools.partial(data_parallel.train, idioms=()),
}


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"data_parallel_device_put"}))
def test_port_bitwise(name: str) -> None:
    assert_same_run(PROGRAMS[name](False), PROGRAMS[name](True))


@pytest.mark.parametrize("idioms", [(), ("eager",), ("in_step",), ("eager", "in_step")],
                         ids=["device_put", "eager", "in_step", "eager+in_step"])
def test_port_data_parallel(idioms: tuple[str, ...]) -> None:
    """Params replicated with `jax.device_put`, and Equinox's `filter_shard((model,
    opt_state), replicated)` after `init` and/or in the step: bitwise equal, each state
    leaf replicated on the 4 devices and in host memory."""
    ported = data_parallel.train(True, idioms)
    assert_same_run(data_parallel.train(False, idioms), ported)
    mesh_devices = set(data_parallel.mesh().devices.flat)
    offloaded = [x for x in jtu.tree_leaves(ported.opt_state) if x.ndim >= 1]
    assert offloaded
    for leaf in offloaded:
        assert leaf.sharding.device_set == mesh_devices and leaf.sharding.is_fully_replicated
        assert leaf.sharding.memory_kind == "pinned_host"


def test_port_filter_pmap() -> None:
    """Either bitwise equal with the per-replica state in host memory, or an
    OffloadError that names what to use (it refuses: pmap places arguments on the device)."""
    plain = data_parallel.train_pmap(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", eqx_offload.errors.OffloadWarning)
            ported = data_parallel.train_pmap(True)
    except eqx_offload.OffloadError as error:
        assert re.search(r"filter_jit|filter_shard|shard", str(error)), error
        return
    except eqx_offload.errors.OffloadWarning as warning:
        raise AssertionError(f"the state was not offloaded: {warning}") from None
    assert_tree_equal((plain.losses, plain.model, plain.opt_state),
                      (ported.losses, ported.model, unwrap(ported.opt_state)))
    for kinds in ported.placements:
        assert sorted(set(kinds.values())) == ["device", "pinned_host"], kinds


def donated_child() -> dict[str, Any]:
    """Per program, plain and ported with `donate="all"`: the first difference or None."""
    return {name: _difference(program(False, donate="all"), program(True, donate="all"))
            for name, program in sorted(PROGRAMS.items())}


@pytest.mark.slow
def test_ports_donated() -> None:
    """The README's `donate="all"`, in a fresh process (a donation bug would abort it)."""
    assert call_isolated(donated_child) == {name: None for name in PROGRAMS}


def linen_child() -> dict[str, Any]:
    """Flax linen `TrainState`, plain (`jax.jit(donate_argnums=0)`) and ported
    (`eqx_offload.jit`): first difference, compilations, final `step`, deleted leaves."""
    plain, ported = linen_trainstate.train(False), linen_trainstate.train(True)
    return {
        "difference": _difference(plain, ported),
        "compiles": [plain.compiles, ported.compiles],
        "step": [[type(r.extra[0]).__name__, str(getattr(r.extra[0], "dtype", None)),
                  int(r.extra[0])] for r in (plain, ported)],
        "deleted": [r.extra[1] for r in (plain, ported)],
    }


def test_port_flax_linen_train_state() -> None:
    """In a fresh process: bitwise equal, moments in pinned_host, one compilation in 5
    steps, `step` an int32 array, every state array passed in donated as plain JAX does."""
    results = call_isolated(linen_child)
    assert results["difference"] is None, results["difference"]
    assert results["compiles"] == [[1, 0, 0, 0, 0]] * 2
    assert results["step"] == [["ArrayImpl", "int32", 5]] * 2
    plain, ported = results["deleted"]
    assert plain == ported
    # (the first call's `step` is the Python int 0: nothing to delete)
    assert plain[0][0] is None and all(all(d) for d in [plain[0][1:], *plain[1:]])


def _rosenbrock(p: dict[str, jax.Array]) -> jax.Array:
    x = p["x"]
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2) + jnp.sum(p["w"] ** 2)


def _lbfgs_run(port: bool, steps: int = 6) -> Run:
    """optax's L-BFGS recipe with `value_and_grad_from_state`; ported with `eqx_offload.jit`."""
    opt = eqx_offload.offloaded(optax.lbfgs()) if port else optax.lbfgs()
    params = {"x": jnp.linspace(-1.0, 1.5, 6), "w": jnp.ones((2, 3))}
    state = opt.init(params)
    value_and_grad = optax.value_and_grad_from_state(_rosenbrock)

    @(eqx_offload.jit if port else jax.jit)
    def step(params, state):
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad,
                                    value_fn=_rosenbrock)
        return optax.apply_updates(params, updates), state, value

    recorder = Recorder(port)
    for _ in range(steps):
        with recorder.step():
            params, state, value = step(params, state)
        recorder.record(value, state)
    return recorder.run(params, state)


def test_port_lbfgs_value_and_grad_from_state() -> None:
    """The line search's `grad` stays on the device, the L-BFGS memory goes to host:
    bitwise equal, compiled as often as plain jax.jit (twice: `init` makes `info` weakly
    typed, `update` strongly)."""
    plain, ported = _lbfgs_run(False), _lbfgs_run(True)
    assert_tree_equal((plain.losses, plain.model, plain.opt_state),
                      (ported.losses, ported.model, unwrap(ported.opt_state)))
    assert plain.compiles == ported.compiles == [1, 1, 0, 0, 0, 0]
    assert len({np.asarray(x).tobytes() for x in plain.losses}) == len(plain.losses)
    expected = expected_placement(ported.opt_state)
    assert "pinned_host" in expected.values()
    assert expected[".inner_state[2].grad['x']"] == "device"
    assert ported.placements == [expected] * len(ported.losses)


# --------------------------------------------------------- reading and writing a state


def _xy(step: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(100 + step), (16, 3))
    return x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)


def _reading_loop(port: bool, optim: Any, read: Callable[[Any, Any], Any],
                  write: Optional[Callable[[Any, int], Any]] = None, steps: int = 4,
                  where: Any = None) -> dict[str, Any]:
    """Trains a small MLP with `optim` (ported with `where` if given, or plain); before
    each step `write(state, step)` may change the state, after it `read(state, model)`."""
    if port:
        optim = eqx_offload.offloaded(optim, **({} if where is None else {"where": where}))
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(3))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @(eqx_offload.filter_jit if port else eqx.filter_jit)
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    reads, losses = [], []
    for i in range(steps):
        if write is not None:
            opt_state = write(opt_state, i)
        model, opt_state, loss = step(model, opt_state, *_xy(i))
        losses.append(loss)
        reads.append(read(opt_state, model))
    return {"reads": reads, "losses": losses, "model": model, "state": unwrap(opt_state),
            "kinds": expected_placement(opt_state), "placed": placement(opt_state)}


def _set_lr_in_place(opt_state: Any, step: int) -> Any:
    opt_state.hyperparams["learning_rate"] = jnp.asarray(0.05 / (step + 1), jnp.float32)
    return opt_state


def _set_lr_python_float(opt_state: Any, step: int) -> Any:
    opt_state.hyperparams["learning_rate"] = 0.05 / (step + 1)
    return opt_state


def _set_lr_tree_set(opt_state: Any, step: int) -> Any:
    return optax.tree.set(opt_state, learning_rate=jnp.asarray(0.05 / (step + 1), jnp.float32))


def _inject_adamw() -> Any:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=0.05, weight_decay=1e-3)


def _read_lr(s: Any, m: Any) -> Any:
    return s.hyperparams["learning_rate"]


# idiom -> (optimizer, read, write, `offloaded`'s `where`)
READING_IDIOMS: dict[str, tuple[Callable[[], Any], Callable[[Any, Any], Any], Any, Any]] = {
    "hyperparams_read": (_inject_adamw, _read_lr, None, None),
    "hyperparams_write_in_place": (_inject_adamw, _read_lr, _set_lr_in_place, None),
    "tree_get": (_inject_adamw, lambda s, m: (optax.tree.get(s, "learning_rate"),
                                              optax.tree_utils.tree_get(s, "weight_decay")),
                 None, None),
    "tree_set": (_inject_adamw, lambda s, m: optax.tree.get(s, "learning_rate"),
                 _set_lr_tree_set, None),
    "schedule_free_eval_params": (
        lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2),
        lambda s, m: optax.contrib.schedule_free_eval_params(s, eqx.filter(m, eqx.is_array)),
        None, None),
    # where=True: the assignment into `hyperparams` (a device copy) reaches the host state.
    "host_resident_write_array": (_inject_adamw, _read_lr, _set_lr_in_place, True),
    "host_resident_write_python_float": (_inject_adamw, _read_lr, _set_lr_python_float, True),
    # Indexing and the attributes of tuples (`count`, `index`) read the inner state.
    "index_count": (lambda: optax.adam(0.05), lambda s, m: s[0].count, None, None),
    "index_moments": (lambda: optax.adam(0.05), lambda s, m: (s[0].mu, s[-2].nu), None, None),
    "index_chain": (lambda: optax.chain(optax.clip(1.0), optax.adamw(0.05)),
                    lambda s, m: (s[1][0].count, s[1][0].mu, s[1][1:]), None, None),
    "index_inject": (_inject_adamw, lambda s, m: (s.count, s[0], s[1]["learning_rate"], s[-1][0].mu),
                     None, None),
    "tree_get_count": (lambda: optax.adam(0.05),
                       lambda s, m: (optax.tree_utils.tree_get(s, "count"), optax.tree.get(s, "count")),
                       None, None),
    "logged_count": (lambda: optax.adam(0.05), lambda s, m: f"step {int(s[0].count)}", None, None),
}


@pytest.mark.parametrize("idiom", list(READING_IDIOMS))
def test_reading_a_state(idiom: str) -> None:
    """What the plain program reads and writes in its state, the ported one reads and
    writes the same way: same values, bitwise equal training, state in host memory."""
    make, read, write, where = READING_IDIOMS[idiom]
    plain = _reading_loop(False, make(), read, write)
    ported = _reading_loop(True, make(), read, write, where=where)
    if where is not None:  # (the plain state may hold the Python float written)
        plain["reads"] = jtu.tree_map(jnp.asarray, plain["reads"])
    for key in ("reads", "losses", "model", "state"):
        assert_tree_equal(plain[key], ported[key])
    assert "pinned_host" in ported["kinds"].values()
    if where is not None:
        expected = [float(np.float32(0.05 / (i + 1))) for i in range(4)]
        assert [float(x) for x in ported["reads"]] == expected
        assert set(ported["placed"].values()) == {"pinned_host"}, ported["placed"]
    elif write is not None:  # the writes changed the training (so they were not lost)
        unchanged = _reading_loop(False, make(), read, None)
        assert not all(np.array_equal(a, b) for a, b in zip(unchanged["losses"], plain["losses"]))


@pytest.mark.parametrize("where", [None, True])
def test_indexing_a_state_reads_the_inner_state(where: Any) -> None:
    """`opt_state[0].count` is Adam's step counter on the device, as with plain optax
    (not `tuple.count`); the pytree stays a one-field NamedTuple in host memory."""
    params = {"w": jnp.ones((3, 3))}
    plain = optax.adam(1e-3).init(params)
    state = eqx_offload.offloaded(optax.adam(1e-3), **({} if where is None else {"where": where})
                                  ).init(params)
    for read in (lambda s: s[0].count, lambda s: s[0].mu["w"], lambda s: s[-1]):
        value, expected = read(state), read(plain)
        assert_tree_equal(value, expected)
        assert {x.sharding.memory_kind for x in jtu.tree_leaves(value)} <= {"device"}
    assert not callable(state[0].count)
    assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
    if where is True:
        assert state.inner_state[0].count.sharding.memory_kind == "pinned_host"
    assert len(state) == 1 and tuple(state) == (state.inner_state,)
    assert jtu.tree_structure(state).num_leaves == 3
    with pytest.raises(AttributeError, match="nor has its inner_state"):
        _ = eqx_offload.offloaded(optax.sgd(0.1)).init(params).count_  # a typo
    with pytest.raises(IndexError):  # as `optax.adam(1e-3).init(params)[2]`
        _ = state[2]
    counter = optax.GradientTransformation(lambda p: jnp.zeros((), jnp.int32),
                                           lambda u, s, p=None: (u, s + 1))
    with pytest.raises(TypeError, match=r"inner_state\['a'\].*\(ArrayImpl\) cannot be"):
        _ = eqx_offload.offloaded(counter).init(params)["a"]


def test_indexing_a_state_inside_the_step() -> None:
    """Read by index inside a jitted step, the host-resident leaves come to the device
    and can be computed on: the same values as plain optax's."""
    params = {"w": jnp.arange(9.0).reshape(3, 3)}

    def step(opt: Any, filter_jit: Any) -> Any:
        state = opt.init(params)
        _, state = jax.jit(opt.update)(params, state, params)
        return filter_jit(lambda s: (s[0].count + 1, s[0].mu["w"] * 2, s[0].nu["w"].sum()))(state)

    assert_tree_equal(step(eqx_offload.offloaded(optax.adam(1e-3)), eqx_offload.filter_jit),
                      step(optax.adam(1e-3), eqx.filter_jit))


def test_multi_steps_has_updated() -> None:
    """`MultiSteps.has_updated(opt_state)` on `offloaded(MultiSteps(...))`'s state."""
    def run(port: bool) -> dict[str, Any]:
        multi = optax.MultiSteps(optax.adam(0.05), every_k_schedule=3)
        return _reading_loop(port, multi, lambda s, m: multi.has_updated(s), steps=7)

    plain, ported = run(False), run(True)
    assert [bool(x) for x in plain["reads"]] == [False, False, True, False, False, True, False]
    assert_tree_equal(plain["reads"], ported["reads"])
    # XLA fuses the plain inner update with the parameter update, the port runs it in a
    # branch of its own: the last bit may differ (its `update` is bitwise: test_accumulate).
    for a, b in zip(jax.tree.leaves(eqx.filter((plain["model"], plain["state"]), eqx.is_array)),
                    jax.tree.leaves(eqx.filter((ported["model"], ported["state"]), eqx.is_array))):
        assert np.allclose(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------- states this optimizer made are accepted


class _ScalarsState(NamedTuple):
    count: int
    decay: float
    warm: bool
    nothing: None
    extra: dict[str, Any]
    trace: Any
    name: Any  # a str (or None)


def _python_scalar_state(name: Optional[str]) -> optax.GradientTransformation:
    """A user-written momentum whose state mixes Python scalars with arrays."""

    def init_fn(params: Any) -> _ScalarsState:
        return _ScalarsState(0, 0.9, False, None, {"steps": 0, "scale": 1.0},
                             jtu.tree_map(jnp.zeros_like, params), name)

    def update_fn(updates: Any, state: _ScalarsState, params: Any = None) -> Any:
        trace = jtu.tree_map(lambda t, u: state.decay * t + u, state.trace, updates)
        new = _ScalarsState(state.count + 1, state.decay, True, None,
                            {"steps": state.extra["steps"] + 1, "scale": state.extra["scale"]},
                            trace, state.name)
        return jtu.tree_map(lambda t: -0.1 * state.extra["scale"] * t, trace), new

    return optax.GradientTransformation(init_fn, update_fn)


@pytest.mark.parametrize("mode", ["eager", "filter_jit"])
@pytest.mark.parametrize("name", [None, "momentum"], ids=["numbers", "with_str"])
def test_python_scalars_in_state(name: Optional[str], mode: str) -> None:
    """The state comes back from every step as the plain optimizer's; arrays go to host,
    Python values stay."""
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    plain = _python_scalar_state(name)
    opt = eqx_offload.offloaded(_python_scalar_state(name))
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    plain_update = plain.update if mode == "eager" else eqx.filter_jit(plain.update)
    state, plain_state = opt.init(params), plain.init(params)
    for step in range(3):
        grads = jtu.tree_map(lambda p: p * (step + 1), params)
        # The changing int `count` recompiles each step under filter_jit: one warning.
        warns = mode == "filter_jit" and step == 2
        with (pytest.warns(eqx_offload.errors.OffloadWarning, match=r"`state`, leaf .*count")
              if warns else contextlib.nullcontext()):
            updates, state = update(grads, state, params)
        plain_updates, plain_state = plain_update(grads, plain_state, params)
        assert_tree_equal((plain_updates, plain_state), (updates, state.inner_state))
        assert state.inner_state.count == step + 1 and state.inner_state.warm is True
        assert state.inner_state.trace["w"].sharding.memory_kind == "pinned_host"


def _monitored() -> optax.GradientTransformation:
    """`optax.monitor` adds its measurements to the state at the first update."""
    return optax.chain(
        optax.sgd(0.1, momentum=0.9),
        optax.monitor({"norm": optax.tree.norm,
                       "norm_ema": optax.measure_with_ema(optax.tree.norm, 0.9, True)}),
        optax.clip_by_global_norm(0.05),
    )


def _per_example_sgd() -> optax.GradientTransformation:
    """An aggregator: its updates carry a per-example axis that the params lack."""
    from optax.experimental import aggregating

    return aggregating.process(
        optax.identity(),
        aggregating.average_incrementally_updates(per_elt_axis=0, accumulation_steps=1),
        optax.sgd(0.1, momentum=0.9),
    )


@pytest.mark.parametrize("name", ["monitor", "per_example_aggregator"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_state_made_by_this_optimizer_accepted(name: str, mode: str) -> None:
    make = {"monitor": _monitored, "per_example_aggregator": _per_example_sgd}[name]
    plain, opt = make(), eqx_offload.offloaded(make())
    update, plain_update = opt.update, plain.update
    if mode == "jit":
        update, plain_update = jax.jit(update), jax.jit(plain_update)
    params = {"w": jnp.arange(6.0).reshape(2, 3) / 5, "b": jnp.linspace(-1.0, 1.0, 3)}
    state, plain_state = opt.init(params), plain.init(params)
    for step in range(3):
        grads = jtu.tree_map(lambda p: jnp.cos(p * (step + 1)), params)
        if name == "per_example_aggregator":
            grads = jtu.tree_map(lambda g: jnp.stack([g, 2 * g, -g, 0.5 * g]), grads)
        updates, state = update(grads, state, params)
        plain_updates, plain_state = plain_update(grads, plain_state, params)
        assert_tree_equal((plain_updates, plain_state), (updates, state.inner_state))
        assert "pinned_host" in expected_placement(state).values()
        assert jtu.tree_map(lambda x: x.sharding.memory_kind, state) == jtu.tree_map(
            lambda x: "pinned_host" if x.ndim else "device", state)


# ------------------------------------ extra `update` arguments reach every transformation

_FACTORY_ARGS: dict[str, Any] = {
    "learning_rate": 0.05, "max_backtracking_steps": 6, "max_linesearch_steps": 6}
# The extra `update` arguments, given (params, grads, loss).
_EXTRA_VALUES: dict[str, Callable[[Any, Any, Callable[[Any], Any]], Any]] = {
    "value": lambda params, grads, loss: loss(params),
    "grad": lambda params, grads, loss: grads,
    "value_fn": lambda params, grads, loss: loss,
    "obj_fn": lambda params, grads, loss: loss,
}


def _extra_params() -> dict[str, jax.Array]:
    return {"w": jnp.arange(6.0).reshape(2, 3) / 4 - 0.5, "b": jnp.array([0.3, -0.2, 0.9])}


def _extra_loss(params: Any) -> jax.Array:
    return jnp.sum((params["w"] - 1.0) ** 2) + jnp.sum(jnp.cos(params["b"])) + 3.0


def _required_args(factory: Callable[..., Any]) -> Optional[dict[str, Any]]:
    """Arguments to build `factory` with, or None if it needs one we cannot give."""
    kwargs = {}
    for p in inspect.signature(factory).parameters.values():
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.name not in _FACTORY_ARGS:
            return None
        kwargs[p.name] = _FACTORY_ARGS[p.name]
    return kwargs


def _asked_for(error: Exception) -> list[str]:
    """The extra arguments an `update` error says are missing."""
    missing = re.search(r"missing \d+ required keyword-only arguments?: (.*)", str(error))
    if missing:
        return re.findall(r"'(\w+)'", missing.group(1))
    return re.findall(r"(\w+) must be provided", str(error))


@functools.cache
def extra_args_transformations() -> dict[str, tuple[Callable[..., Any], dict[str, Any],
                                                   tuple[str, ...]]]:
    """Every public factory of `optax` and `optax.contrib` whose `update` fails without
    extra arguments: name -> (factory, its arguments, the extra argument names)."""
    params = _extra_params()
    grads = jax.grad(_extra_loss)(params)
    found = {}
    for prefix, namespace in (("optax", optax), ("optax.contrib", optax.contrib)):
        for name in sorted(dir(namespace)):
            factory = getattr(namespace, name)
            if name.startswith("_") or not inspect.isfunction(factory):
                continue
            kwargs = _required_args(factory)
            if kwargs is None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated aliases
                try:
                    transformation = factory(**kwargs)
                except Exception:  # not a transformation factory
                    continue
                if not isinstance(transformation, optax.GradientTransformation):
                    continue
                try:  # traced only: nothing is compiled or run
                    jax.eval_shape(lambda g, p: transformation.update(g, transformation.init(p), p),
                                   grads, params)
                except (TypeError, ValueError) as error:
                    if asked := _asked_for(error):
                        found[f"{prefix}.{name}"] = (factory, kwargs, tuple(asked))
    return found


def test_extra_args_discovery() -> None:
    """The discovery finds the known ones, and every argument they ask for has a value
    here: a new one in a future optax fails this test."""
    found = extra_args_transformations()
    assert {
        "optax.polyak_sgd", "optax.scale_by_polyak", "optax.lbfgs",
        "optax.scale_by_backtracking_linesearch", "optax.scale_by_zoom_linesearch",
        "optax.contrib.momo", "optax.contrib.momo_adam", "optax.contrib.reduce_on_plateau",
        "optax.contrib.sophia",
    } <= set(found)
    asked = {name for _, _, names in found.values() for name in names}
    assert asked <= set(_EXTRA_VALUES), asked - set(_EXTRA_VALUES)


# composition -> how to build it around (factory, kwargs)
COMPOSE_EXTRA: dict[str, Callable[[Callable[..., Any], dict[str, Any]], Any]] = {
    "bare": lambda f, kw: f(**kw),
    "MultiSteps": lambda f, kw: optax.MultiSteps(f(**kw), every_k_schedule=2),
    "chain": lambda f, kw: optax.chain(optax.clip_by_global_norm(10.0), f(**kw)),
    "inject_hyperparams": lambda f, kw: optax.inject_hyperparams(f)(**kw),
    "masked": lambda f, kw: optax.masked(f(**kw), {"w": True, "b": False}),
    "multi_transform": lambda f, kw: optax.multi_transform(
        {"inner": f(**kw), "sgd": optax.sgd(0.1, momentum=0.5)}, {"w": "inner", "b": "sgd"}),
    "apply_if_finite": lambda f, kw: optax.apply_if_finite(f(**kw), 3),
}
# mode -> (`offloaded`'s options, the compositions it runs)
MODES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "default": ({}, tuple(COMPOSE_EXTRA)),
    "streamed": ({"group_bytes": 0}, ("bare", "chain")),
    "host": ({"compute": "host"}, ("bare", "chain")),
}
# What each non-default mode runs; it refuses the rest (host compute: `while`/`scan`/`cond`;
# streaming: coupled state) with a CompositionError.
MODE_RUNS: dict[str, set[str]] = {
    "streamed": {"optax.polyak_sgd", "optax.scale_by_polyak", "optax.contrib.reduce_on_plateau",
                 "optax.scale_by_backtracking_linesearch", "optax.scale_by_zoom_linesearch"},
    "host": {"optax.polyak_sgd", "optax.scale_by_polyak", "optax.contrib.reduce_on_plateau",
             "optax.contrib.momo", "optax.contrib.momo_adam",
             "optax.contrib.hutchinson_estimator_diag_hessian"},
}
# Every transformation runs bare and chained in every mode; the other compositions run one
# per set of extra arguments, and reduce_on_plateau (inject_hyperparams refuses it).
EVERY_COMPOSITION = {
    "optax.polyak_sgd", "optax.contrib.sophia", "optax.scale_by_backtracking_linesearch",
    "optax.contrib.reduce_on_plateau",
}


def _extra_args_cases() -> list[Any]:
    found = extra_args_transformations()
    assert EVERY_COMPOSITION <= set(found)
    assert {found[n][2] for n in EVERY_COMPOSITION} == {names for _, _, names in found.values()}
    return [
        pytest.param(name, composition, mode, id=f"{name}-{composition}-{mode}")
        for name in sorted(found)
        for mode, (_, compositions) in MODES.items()
        for composition in compositions
        if composition in ("bare", "chain") or name in EVERY_COMPOSITION
    ]


def _run_extra(opt: Any, names: tuple[str, ...], jit: Callable[..., Any], steps: int = 3) -> Any:
    params = _extra_params()
    state = opt.init(params)
    update = jit(opt.update)
    out = []
    for _ in range(steps):
        grads = jax.grad(_extra_loss)(params)
        extra = {n: _EXTRA_VALUES[n](params, grads, _extra_loss) for n in names}
        updates, state = update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
        out.append((updates, state))
    return out, params


@functools.cache
def _plain_extra(name: str, composition: str) -> Any:
    """The unwrapped composition's run (shared by the modes), or the error it raises."""
    factory, kwargs, names = extra_args_transformations()[name]
    try:
        return _run_extra(COMPOSE_EXTRA[composition](factory, kwargs), names, eqx.filter_jit)
    except Exception as error:
        return error


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""


@pytest.mark.parametrize("name,composition,mode", _extra_args_cases())
def test_extra_args_reach_the_inner_transformation(name: str, composition: str, mode: str) -> None:
    """offloaded(composition(T)) with T's extra arguments, under `eqx_offload.filter_jit`,
    is bitwise equal to the unwrapped composition with the state in host memory; it
    fails as the unwrapped one fails, or refuses a mode with a CompositionError."""
    factory, kwargs, names = extra_args_transformations()[name]
    ported = eqx_offload.offloaded(COMPOSE_EXTRA[composition](factory, kwargs), **MODES[mode][0])
    expected = _plain_extra(name, composition)
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)) as ported_error:
            _run_extra(ported, names, eqx_offload.filter_jit)
        assert _first_line(ported_error.value) == _first_line(expected)
        return
    try:
        (steps, params) = _run_extra(ported, names, eqx_offload.filter_jit)
    except eqx_offload.errors.CompositionError as error:
        assert mode != "default" and name not in MODE_RUNS[mode], error
        assert re.search(r"group_bytes|compute", str(error)), error
        return
    expected_steps, expected_params = expected
    for (plain_updates, plain_state), (updates, state) in zip(expected_steps, steps):
        if composition == "MultiSteps":
            # A mini-step that does not apply: `0 * u` (-0.0 where `u < 0`) against +0.0.
            assert all(np.array_equal(a, b) for a, b in zip(
                jax.tree.leaves(plain_updates), jax.tree.leaves(updates)))
        else:
            assert_tree_equal(plain_updates, updates)
        assert_tree_equal(unwrap(plain_state), unwrap(state))
        assert placement(state) == expected_placement(state)
    assert_tree_equal(expected_params, params)
