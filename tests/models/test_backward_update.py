"""`update_in_backward`: the stacked layers updated inside the backward pass are bitwise
the normal step (grad, then update, then apply) for optimizers that treat each
parameter and layer apart, with state in host memory, master weights, weights in host
memory and a bf16 host state; where everything lives; donation; and the refusals of
what it cannot do exactly."""

import functools
import os
import pathlib
import subprocess
import sys
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_tree_equal, memory_kinds, unchecked, walk_eqns

import eqx_offload
from eqx_offload.errors import CompositionError, OptionError, StateError


WIDTH, LAYERS, BATCH = 8, 3, 2
ROOT = pathlib.Path(__file__).parents[2]


class Block(eqx.Module):
    """A residual layer with a matrix, a bias and a norm-like scale vector."""

    linear: eqx.nn.Linear
    scale: jax.Array

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.scale = jnp.ones(WIDTH) + 0.1 * jax.random.normal(key, (WIDTH,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(x * self.scale))


class Model(eqx.Module):
    """An embedding, stacked blocks run by `scan_layers`, and a head."""

    embed: jax.Array
    blocks: Block
    head: eqx.nn.Linear
    offload_input: bool = eqx.field(static=True, default=False)

    def __call__(self, x: jax.Array, accumulate: Optional[Any] = None) -> jax.Array:
        h = eqx_offload.scan_layers(self.blocks, x * self.embed,
                                    offload_input=self.offload_input, accumulate=accumulate)
        return self.head(h)


def make_model(offload_input: bool = False, host_blocks: bool = False) -> Model:
    ke, kb, kh = jax.random.split(jax.random.key(0), 3)
    model = Model(1.0 + 0.1 * jax.random.normal(ke, (WIDTH,)),
                  eqx.filter_vmap(Block)(jax.random.split(kb, LAYERS)),
                  eqx.nn.Linear(WIDTH, 1, key=kh), offload_input)
    if host_blocks:
        model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return model


def loss(model: Model, x: jax.Array) -> jax.Array:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def batch(step: int) -> jax.Array:
    return jax.random.normal(jax.random.key(100 + step), (BATCH, WIDTH))


def _is_matrix(tree: Any) -> Any:
    return jax.tree.map(lambda p: p.ndim >= 2, tree)


ADAFACTOR = optax.adafactor(1e-2, min_dim_size_to_factor=4, clipping_threshold=None,
                            multiply_by_parameter_scale=False)
OPTIMIZERS = {
    "adam": optax.adam(1e-2),
    "adamw-mask": optax.adamw(1e-2, weight_decay=0.1, mask=_is_matrix),
    "lion": optax.lion(1e-3, weight_decay=0.01),
    "sgd-momentum": optax.sgd(1e-2, momentum=0.9),
    "adafactor-factored": ADAFACTOR,
}


def _normal_step(optimizer: Any, host_blocks: bool) -> Any:
    """The normal step: the whole gradient, then the update, then `apply_updates`."""
    apply = eqx_offload.apply_updates if host_blocks else eqx.apply_updates

    @eqx_offload.filter_jit
    def step(model: Model, state: Any, x: jax.Array) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, x)
        if isinstance(optimizer, (eqx_offload.types.MasterWeights,
                                  eqx_offload.types.HostWeightsOptimizer)):
            model, state = optimizer.update(grads, state, model)
            return value, model, state
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return value, apply(model, updates), state

    return step


def _init_normal(optimizer: Any, model: Model) -> tuple[Model, Any]:
    if isinstance(optimizer, eqx_offload.types.MasterWeights):
        return optimizer.init(model)
    if isinstance(optimizer, eqx_offload.types.HostWeightsOptimizer):
        return model, optimizer.init(model)
    return model, optimizer.init(eqx.filter(model, eqx.is_array))


def _run_both(optimizer: Any, steps: int = 3, offload: Any = None, normal_optimizer: Any = None,
              **model_options: Any) -> tuple[Any, Any]:
    """Both steps for `steps` batches from one model: `((model, state), (model,
    state))`, the fused state's halves combined into the normal state's tree. The fused
    step is `update_in_backward(optimizer, offload=offload)`; the normal step's optimizer
    `normal_optimizer` (default `optimizer`)."""
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks,
                                           offload=offload)
    optimizer = optimizer if normal_optimizer is None else normal_optimizer
    model, state = fused.init(make_model(**model_options))
    normal_model, normal_state = _init_normal(optimizer, make_model(**model_options))
    step = eqx_offload.filter_jit(functools.partial(fused.step, loss))
    normal = _normal_step(optimizer, model_options.get("host_blocks", False))
    for i in range(steps):
        value, model, state = step(model, state, batch(i))
        normal_value, normal_model, normal_state = normal(normal_model, normal_state, batch(i))
        assert_tree_equal(value, normal_value)
    return ((model, eqx.combine(state.layers, state.rest)), (normal_model, normal_state))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offloaded"])
def test_bitwise_the_normal_step(name: str, offload: bool) -> None:
    optimizer = OPTIMIZERS[name]
    if offload:
        optimizer = eqx_offload.offloaded(optimizer)
    assert_tree_equal(*_run_both(optimizer))


@pytest.mark.slow
def test_bitwise_the_normal_step_without_avx512() -> None:
    """The same claims where XLA:CPU compiles for AVX2 and FMA, without AVX-512 (as on an
    AMD EPYC of that kind): in a child process, since the instruction set is fixed when
    the backend starts."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("EQX_OFFLOAD_TEST_JAX_CACHE", "PYTEST_XDIST_WORKER")}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2").strip()
    test = f"{pathlib.Path(__file__).relative_to(ROOT)}::test_bitwise_the_normal_step"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", test], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{2 * len(OPTIMIZERS)} passed" in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("case", ["offloaded", "bf16", "master_weights", "host_weights"])
def test_offload_composes(case: str) -> None:
    """`update_in_backward(optimizer, offload=...)`, the optimizer unwrapped and how to
    keep its state apart, as `master_weights(inner, offload=...)` takes them: bitwise
    the normal step of the optimizer that `offload` wraps, every state leaf in the
    memory the normal step's is in."""
    adam, options = optax.adam(1e-2), {}
    if case == "offloaded":
        fused_args = (adam, eqx_offload.offloaded)
        normal_optimizer = eqx_offload.offloaded(adam)
    elif case == "bf16":
        fused_args = (adam, functools.partial(eqx_offload.offloaded, host_dtype=jnp.bfloat16))
        normal_optimizer = eqx_offload.offloaded(adam, host_dtype=jnp.bfloat16)
    elif case == "master_weights":
        fused_args = (eqx_offload.master_weights(adam, offload=None), eqx_offload.offloaded)
        normal_optimizer = eqx_offload.master_weights(adam)
    else:
        fused_args = (eqx_offload.host_weights_optimizer(adam, offload=None),
                      eqx_offload.offloaded)
        normal_optimizer = eqx_offload.host_weights_optimizer(adam)
        options = {"host_blocks": True}
    fused, normal = _run_both(fused_args[0], offload=fused_args[1],
                              normal_optimizer=normal_optimizer, **options)
    assert memory_kinds(fused) == memory_kinds(normal)
    assert "pinned_host" in memory_kinds(fused[1]).values()
    assert_tree_equal(fused, normal)


def test_state_in_host_memory_stays_there() -> None:
    """Every state leaf `offloaded` keeps in host memory is there after the step, the
    layers' stacked moments included; the model's leaves stay on the device."""
    fused, normal = _run_both(eqx_offload.offloaded(optax.adamw(1e-2)), steps=1)
    assert memory_kinds(fused[1]) == memory_kinds(normal[1])
    assert fused[1].inner_state[0].mu.blocks.linear.weight.sharding.memory_kind == "pinned_host"
    assert set(memory_kinds(fused[0]).values()) == {"device"}


def test_bf16_host_state() -> None:
    optimizer = eqx_offload.offloaded(optax.adam(1e-2), host_dtype=jnp.bfloat16)
    fused, normal = _run_both(optimizer)
    assert fused[1].inner_state[0].nu.blocks.linear.weight.dtype == jnp.bfloat16
    assert_tree_equal(fused, normal)


def test_master_weights() -> None:
    fused, normal = _run_both(eqx_offload.master_weights(optax.adamw(1e-2)))
    assert fused[0].blocks.linear.weight.dtype == jnp.bfloat16
    master = fused[1].inner_state.master.blocks.linear.weight
    assert master.dtype == jnp.float32 and master.sharding.memory_kind == "pinned_host"
    assert_tree_equal(fused, normal)


def test_master_weights_with_weights_and_inputs_in_host_memory() -> None:
    """bf16 compute weights of the layers in host memory (their bf16 scale vectors come
    to the device whole), fp32 master weights and state in host memory, the layers'
    inputs too: the capacity benchmark's `+activations` mode."""
    fused, normal = _run_both(eqx_offload.master_weights(optax.adamw(1e-2)),
                              host_blocks=True, offload_input=True)
    assert fused[0].blocks.scale.sharding.memory_kind == "pinned_host"
    assert fused[0].blocks.scale.dtype == jnp.bfloat16
    assert_tree_equal(fused, normal)


@pytest.mark.parametrize("offload", [None, eqx_offload.offloaded],
                         ids=["device-state", "offloaded"])
def test_weights_in_host_memory(offload: Any) -> None:
    optimizer = eqx_offload.host_weights_optimizer(optax.adam(1e-2), offload=offload)
    fused, normal = _run_both(optimizer, host_blocks=True)
    assert fused[0].blocks.linear.weight.sharding.memory_kind == "pinned_host"
    assert fused[0].blocks.scale.sharding.memory_kind == "pinned_host"
    assert_tree_equal(fused, normal)


def test_offload_input() -> None:
    fused, normal = _run_both(eqx_offload.offloaded(optax.adam(1e-2)), offload_input=True)
    assert_tree_equal(fused, normal)


def test_accumulated_micro_batches() -> None:
    """The sum of earlier micro-batches' gradients (the layers' made by
    `scan_layers(accumulate=...)`) plus the last one's: the normal step on the sum."""
    optimizer = eqx_offload.offloaded(optax.adam(1e-2))
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model, state = fused.init(make_model())
    normal_state = optimizer.init(eqx.filter(model, eqx.is_array))
    first = eqx_offload.filter_jit(eqx.filter_grad(loss))(model, batch(0))

    @eqx_offload.filter_jit
    def normal(model: Model, state: Any, acc: Any, x: jax.Array) -> Any:
        grads = jax.tree.map(jnp.add, acc, eqx.filter_grad(loss)(model, x))
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    step = eqx_offload.filter_jit(functools.partial(fused.step, loss))
    _, new_model, new_state = step(model, state, batch(1), accumulated=first)
    normal_model, normal_state = normal(model, normal_state, first, batch(1))
    assert_tree_equal((new_model, eqx.combine(new_state.layers, new_state.rest)),
                      (normal_model, normal_state))


def test_donated_step() -> None:
    """Under `filter_jit(donate="all")` the model and state passed in are consumed, and
    the step gives the same as without donation."""
    optimizer = eqx_offload.offloaded(optax.adam(1e-2))
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model, state = fused.init(make_model())
    plain = eqx_offload.filter_jit(functools.partial(fused.step, loss))(model, state, batch(0))
    donating = eqx_offload.filter_jit(functools.partial(fused.step, loss), donate="all")
    donated = donating(model, state, batch(0))
    assert_tree_equal(plain, donated)
    assert model.blocks.linear.weight.is_deleted()
    assert state.layers.inner_state[0].mu.blocks.linear.weight.is_deleted()


def test_the_layers_gradient_is_never_whole() -> None:
    """No arithmetic in the step makes a value of a stacked layer's shape: the
    layers' gradient and update exist one layer at a time (the values of that shape
    are the weights and moments, written in place). The normal step's jaxpr has them."""
    optimizer = optax.adam(1e-2)
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model, state = fused.init(make_model())
    stacked = (LAYERS, WIDTH, WIDTH)
    # (calls, whose equations are walked too, and what moves or fences values)
    moves = {"dynamic_update_slice", "scan", "while", "custom_vjp_call", "custom_jvp_call",
             "pjit", "jit", "closed_call", "copy", "copy_p", "device_put",
             "custom_vmap_call", "optimization_barrier"}

    def computing(f: Any, *args: Any) -> set[str]:
        jaxpr = jax.make_jaxpr(f)(*args)
        return {eqn.primitive.name for eqn in walk_eqns(jaxpr) for v in eqn.outvars
                if getattr(v.aval, "shape", None) == stacked} - moves

    normal_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def normal(model: Model, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(loss)(model, x)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    assert computing(lambda m, s, x: fused.step(loss, m, s, x), model, state, batch(0)) == set()
    assert {"add", "mul"} <= computing(normal, model, normal_state, batch(0))


def _error(optimizer: Any) -> str:
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    with pytest.raises(CompositionError) as info:
        fused.init(make_model())
    return str(info.value)


@pytest.mark.parametrize("optimizer, named", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), "reduce_sum"),
    (optax.adafactor(1e-2, min_dim_size_to_factor=4), "reduce_sum"),
    (optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(1e-2)), "reduce_sum"),
], ids=["clip_by_global_norm", "adafactor-clipping", "clip_by_block_rms"])
def test_refuses_an_update_that_needs_every_gradient(optimizer: Any, named: str) -> None:
    message = _error(optimizer)
    assert message.startswith("Use the normal step")
    assert named in message and "models/#the-update-inside-the-backward-pass" in message
    assert len(message.splitlines()) <= 4


class WideBlock(eqx.Module):
    """A layer whose state 8-bit state keeps quantised: a (64, 64) matrix, and a
    vector of 1,536 (a stack of 3 is 4,608 values: packed a layer at a time)."""

    linear: eqx.nn.Linear
    extra: jax.Array

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(64, 64, key=key)
        self.extra = 0.1 * jax.random.normal(key, (1536,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(x)) + jnp.mean(self.extra ** 2)


class Wide(eqx.Module):
    blocks: WideBlock
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(eqx_offload.scan_layers(self.blocks, x))


@pytest.mark.both  # (JAX 0.12 binds searchsorted otherwise: the walk must follow both)
def test_8_bit_state() -> None:
    """8-bit state: the model and loss bitwise the normal step's over three steps; the
    moments' codes and scales bitwise too, a stack of vectors stored a layer at a time
    (`(L, 1 + e, n / 4)`, where the normal step stores `(L + e, n / 4)`)."""
    from eqx_offload._optim.quantize import unpack

    ks = jax.random.split(jax.random.key(0), 4)
    wide = Wide(eqx.filter_vmap(WideBlock)(jax.random.split(ks[0], 3)),
                eqx.nn.Linear(64, 1, key=ks[1]))
    optimizer = eqx_offload.offloaded(optax.adam(1e-2), host_dtype=jnp.int8)
    fused_opt = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model, state = fused_opt.init(wide)
    normal_model, normal_state = wide, optimizer.init(eqx.filter(wide, eqx.is_array))
    step = eqx_offload.filter_jit(functools.partial(fused_opt.step, loss))
    normal = _normal_step(optimizer, False)
    for i in range(3):
        x = jax.random.normal(jax.random.key(10 + i), (BATCH, 64))
        value, model, state = step(model, state, x)
        normal_value, normal_model, normal_state = normal(normal_model, normal_state, x)
        assert_tree_equal((value, model), (normal_value, normal_model))
    for field in ("mu", "nu"):
        fused_moment = getattr(state.layers.inner_state[0], field).blocks
        normal_moment = getattr(normal_state.inner_state[0], field).blocks
        assert fused_moment.linear.weight.dtype == jnp.uint32
        assert fused_moment.linear.weight.sharding.memory_kind == "pinned_host"
        assert_tree_equal(fused_moment.linear, normal_moment.linear)
        assert fused_moment.extra.shape == (3, 2, 384) and normal_moment.extra.shape == (4, 384)
        codes, scales = unpack(fused_moment.extra, (3, 1, 1536))
        assert_tree_equal((codes[:, 0], scales[:, 0]), unpack(normal_moment.extra, (3, 1536)))


def test_8_bit_state_starts_up_where_it_lives() -> None:
    """`filter_make` of the 8-bit state of a model whose embedding is a quarter of the
    stack's width in rows: its start-up plans the update again for one layer of the
    stack (`stack_layers` making one), where the embedding's moments are packed as
    for one layer. The state is made, each leaf as `init` makes it."""
    width, layers = 512, 8  # (8 layers of 512 values: the stack's rows are quantised)

    class Embedded(eqx.Module):
        embed: jax.Array
        blocks: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.sum(eqx_offload.scan_layers(self.blocks, x @ self.embed))

    def make(key: jax.Array) -> Embedded:
        ke, kb = jax.random.split(key)
        blocks = eqx_offload.stack_layers(lambda k: eqx.nn.Linear(width, width, key=k),
                                          jax.random.split(kb, layers))
        return Embedded(jax.random.normal(ke, (16, width)), blocks)

    fused = eqx_offload.update_in_backward(
        optax.adam(1e-2), layers=lambda m: m.blocks,
        offload=functools.partial(eqx_offload.offloaded, host_dtype=jnp.int8))
    model, state = eqx_offload.filter_make(lambda key: fused.init(make(key)),
                                           jax.random.key(0))
    expected = fused.init(make(jax.random.key(0)))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), (model, state)) == jax.tree.map(
        lambda a: (a.shape, a.dtype), expected)
    assert memory_kinds(state) == memory_kinds(expected[1])
    assert state.rest.inner_state[0].mu.embed.dtype == jnp.uint32  # (quantised)
    assert state.layers.inner_state[0].mu.blocks.weight.shape[0] == layers


def test_refuses_an_optimizer_factory_or_offloading_twice() -> None:
    """The fix first: an optimizer factory is not an optimizer (as `offloaded` says),
    and an optimizer `offloaded` already made is not offloaded again."""
    with pytest.raises(eqx_offload.errors.NotATransformationError,
                       match=r"update_in_backward\(optimizer=\.\.\.\)") as info:
        unchecked(eqx_offload.update_in_backward)(optax.adamw, layers=lambda m: m.blocks)
    assert "optax.adamw(" in str(info.value)
    with pytest.raises(OptionError, match="offloaded already") as info:
        eqx_offload.update_in_backward(eqx_offload.offloaded(optax.adam(1e-2)),
                                       layers=lambda m: m.blocks,
                                       offload=eqx_offload.offloaded)
    assert "See https://" in str(info.value)
    with pytest.raises(OptionError, match="pass a function from a transformation"):
        unchecked(eqx_offload.update_in_backward)(optax.adam(1e-2), layers=lambda m: m.blocks,
                                                  offload="offloaded")


def test_refuses_layers_packed_together() -> None:
    """8-bit state made by an `offloaded` nested in the optimizer packs the stack's
    rows together: refused, naming `offload=`."""
    ks = jax.random.split(jax.random.key(0), 2)
    wide = Wide(eqx.filter_vmap(WideBlock)(jax.random.split(ks[0], 3)),
                eqx.nn.Linear(64, 1, key=ks[1]))
    nested = optax.chain(eqx_offload.offloaded(optax.adam(1e-2), host_dtype=jnp.int8))
    fused = eqx_offload.update_in_backward(nested, layers=lambda m: m.blocks)
    with pytest.raises(CompositionError, match=r"update_in_backward\(\.\.\., offload=") as info:
        fused.init(wide)
    assert len(str(info.value).splitlines()) <= 4


def test_refuses_multi_steps() -> None:
    with pytest.raises(CompositionError, match="accumulated="):
        eqx_offload.update_in_backward(optax.MultiSteps(optax.adam(1e-2), 2),
                                       layers=lambda m: m.blocks)
    # `offloaded` outermost (as the accumulation how-to orders them): the same route named
    fused = eqx_offload.update_in_backward(
        eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-2), 2)), layers=lambda m: m.blocks)
    with pytest.raises(CompositionError, match="accumulated="):
        fused.init(make_model())


def test_refuses_a_loss_without_the_scan() -> None:
    fused = eqx_offload.update_in_backward(optax.adam(1e-2), layers=lambda m: m.blocks)
    model, state = fused.init(make_model())

    def no_scan(model: Model, x: jax.Array) -> jax.Array:
        return jnp.sum(model.head(x[0]))

    with pytest.raises(CompositionError, match="Run `eqx_offload.scan_layers` once"):
        fused.step(no_scan, model, state, batch(0))


def test_refuses_a_loss_that_uses_the_layers_elsewhere() -> None:
    fused = eqx_offload.update_in_backward(optax.adam(1e-2), layers=lambda m: m.blocks)
    model, state = fused.init(make_model())

    def also(model: Model, x: jax.Array) -> jax.Array:
        return loss(model, x) + jnp.sum(model.blocks.scale)

    with pytest.raises(CompositionError, match="only through `scan_layers`"):
        fused.step(also, model, state, batch(0))


def test_refuses_bad_arguments() -> None:
    fused = eqx_offload.update_in_backward(optax.adam(1e-2),
                                           layers=lambda m: (m.embed, m.head.weight))
    with pytest.raises(OptionError, match="select stacked layers"):
        fused.init(make_model())
    fused = eqx_offload.update_in_backward(optax.adam(1e-2), layers=lambda m: m.blocks.linear)
    with pytest.raises(OptionError, match="all floating") as info:
        fused.init(eqx.tree_at(lambda m: m.blocks.linear.bias, make_model(),
                               replace_fn=lambda b: b.astype(jnp.int32)))
    assert "{DOCS}" not in str(info.value) and "See https://" in str(info.value)
    fused = eqx_offload.update_in_backward(optax.adam(1e-2), layers=lambda m: None)
    with pytest.raises(OptionError, match="selected no array leaf"):
        fused.init(make_model())
    with pytest.raises(OptionError, match="pass a function"):
        unchecked(eqx_offload.update_in_backward)(optax.adam(1e-2), layers="blocks")
    fused = eqx_offload.update_in_backward(optax.adam(1e-2), layers=lambda m: m.blocks)
    with pytest.raises(StateError):
        unchecked(type(fused).step)(fused, loss, make_model(),
                                    optax.adam(1e-2).init(make_model()), batch(0))


def test_updated_in_the_backward_pass_the_master_stays_fp32() -> None:
    """`update_in_backward` over `master_weights` with bf16 moments, the blocks' bf16
    weights and inputs in host memory (the chip's `+activations-bf16state-backward`):
    bitwise the normal step, the stacked master fp32 and its moments bf16, in host
    memory."""
    optimizer = eqx_offload.master_weights(
        optax.adamw(1e-2, weight_decay=0.1), offload=functools.partial(eqx_offload.offloaded, host_dtype=jnp.bfloat16))
    fused, normal = _run_both(optimizer, host_blocks=True, offload_input=True)
    state = fused[1].inner_state
    master, mu = state.master.blocks.linear.weight, state.inner_state[0].mu.blocks.linear.weight
    assert (master.dtype, master.sharding.memory_kind) == (jnp.dtype(jnp.float32), "pinned_host")
    assert (mu.dtype, mu.sharding.memory_kind) == (jnp.dtype(jnp.bfloat16), "pinned_host")
    assert_tree_equal(fused, normal)


def test_a_tpu_step_compiles_with_two_copies_in_flight_each_way() -> None:
    """`filter_jit` lowers a step that updates inside the backward pass for a TPU with
    `xla_tpu_host_transfer_overlap_limit=2` (its own marked scope), but with 8-bit state,
    and the normal step, with `offloaded`'s 1; the CPU's program gets neither."""
    optimizer = eqx_offload.offloaded(optax.adam(1e-2))
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model, state = fused.init(make_model())
    step = eqx_offload.filter_jit(functools.partial(fused.step, loss))
    normal_model, normal_state = _init_normal(optimizer, make_model())
    normal = _normal_step(optimizer, False)
    eight_bit = eqx_offload.update_in_backward(
        eqx_offload.offloaded(optax.adam(1e-2), host_dtype=jnp.int8), layers=lambda m: m.blocks)
    wide = Wide(eqx.filter_vmap(WideBlock)(jax.random.split(jax.random.key(0), 3)),
                eqx.nn.Linear(64, 1, key=jax.random.key(1)))
    wide, wide_state = eight_bit.init(wide)
    limit = "xla_tpu_host_transfer_overlap_limit"
    for jitted, args, expected in (
            (step, (model, state, batch(0)), 2),
            (normal, (normal_model, normal_state, batch(0)), 1),
            (eqx_offload.filter_jit(functools.partial(eight_bit.step, loss)),
             (wide, wide_state, jnp.ones((BATCH, 64))), 1)):
        assert jitted.lower_for(("tpu",), args, {}).compiler_options[limit] == expected
        assert limit not in jitted.lower_for(("cpu",), args, {}).compiler_options
