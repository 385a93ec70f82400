"""Diagnose offloaded training on an accelerator: where results part from plain, what
the host holds, how fast each direction copies. One experiment per process:

    python bench/tpu/probe.py bitwise WIDTH DEPTH STEPS [highest]
    python bench/tpu/probe.py run MODE WIDTH DEPTH STEPS [donate|keep] [highest]
    python bench/tpu/probe.py copies MIB
    python bench/tpu/probe.py determinism WIDTH DEPTH

Each prints one JSON line per result (and appends it to $OUT/probe.jsonl if set).
"""

import json
import os
import resource
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload


def emit(**record):
    line = json.dumps(record, default=str)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe.jsonl"), "a") as f:
            f.write(line + "\n")


def rss():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                fields[k] = int(v.split()[0]) * 1024
    # (gVisor's /proc has no VmHWM)
    fields["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return fields


def peak_device():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


def model_and_data(width, depth):
    model = eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (512, width))
    y = jax.random.normal(ky, (512, width))
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optimizer):
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss
    return step


def params_np(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def ulp_diff(a, b):
    """Max |difference| in units in the last place, and the fraction of elements that differ."""
    worst, differ, total = 0, 0, 0
    for x, y in zip(a, b):
        xi = x.view(np.int32).astype(np.int64)
        yi = y.view(np.int32).astype(np.int64)
        d = np.abs(xi - yi)
        worst = max(worst, int(d.max()))
        differ += int((d > 0).sum())
        total += d.size
    return worst, differ / total


MODES = {
    "plain": lambda inner: inner,
    "default": lambda inner: eqx_offload.offloaded(inner),
    "whole": lambda inner: eqx_offload.offloaded(inner, group_bytes=None),
}


def train(mode, width, depth, steps, donate=True, record=None, marks=None):
    model, batch = model_and_data(width, depth)
    optimizer = MODES[mode](optax.adamw(1e-3))
    if marks is not None:
        jax.block_until_ready(model)
        marks["rss_model"] = rss()["VmRSS"]
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    if marks is not None:
        jax.block_until_ready(opt_state)
        marks["rss_init"] = rss()["VmRSS"]
    jit = eqx.filter_jit if mode == "plain" else eqx_offload.filter_jit
    step = jit(make_step(optimizer), donate="all" if donate else "none")
    losses, seconds, snaps = [], [], []
    rss_steps = []
    for i in range(steps):
        start = time.perf_counter()
        model, opt_state, loss = step(model, opt_state, batch)
        jax.block_until_ready((model, opt_state, loss))
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
        rss_steps.append(rss()["VmRSS"])
        if record is not None and i in record:
            snaps.append(params_np(model))
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(opt_state)
                    if hasattr(x, "sharding")})
    return losses, seconds, snaps, kinds, rss_steps


def bitwise(width, depth, steps, highest=False):
    """Plain against the offloaded modes, donated and not, in one process."""
    record = (0, steps - 1)
    ref = None
    for mode in ("plain", "default", "whole"):
        for donate in (True, False):
            losses, seconds, snaps, kinds, _ = train(mode, width, depth, steps, donate, record)
            entry = dict(exp="bitwise", mode=mode, donate=donate, width=width, depth=depth,
                         highest=highest, losses=[repr(v) for v in losses],
                         step_ms=[round(s * 1e3, 2) for s in seconds], kinds=kinds)
            if ref is None:
                ref = (losses, snaps)
            else:
                entry["losses_equal"] = losses == ref[0]
                entry["ulp_first"], entry["frac_first"] = ulp_diff(snaps[0], ref[1][0])
                entry["ulp_last"], entry["frac_last"] = ulp_diff(snaps[1], ref[1][1])
            emit(**entry)
    update_alone(width, depth, highest)


def update_alone(width, depth, highest):
    """The same gradients and state through plain and offloaded updates, jitted: where
    do the updates part (the update alone, or fused with apply_updates)?"""
    model, batch = model_and_data(width, depth)
    params = eqx.filter(model, eqx.is_array)
    grads = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, batch)
    inner = optax.adamw(1e-3)
    state = inner.init(params)
    ref_u, _ = jax.jit(inner.update)(grads, state, params)
    ref_u = [np.asarray(x) for x in jax.tree.leaves(ref_u)]
    ref_p = jax.jit(lambda g, s, p: optax.apply_updates(p, inner.update(g, s, p)[0]))(
        grads, state, params)
    ref_p = [np.asarray(x) for x in jax.tree.leaves(ref_p)]
    # eager plain update, op by op
    eager_u = [np.asarray(x) for x in jax.tree.leaves(inner.update(grads, state, params)[0])]
    emit(exp="update", case="eager-plain-vs-jit", ulp=ulp_diff(eager_u, ref_u))
    for mode in ("default", "whole"):
        off = MODES[mode](inner)
        ostate = off.init(params)
        u, _ = eqx_offload.filter_jit(off.update)(grads, ostate, params)
        emit(exp="update", case=f"{mode}-update-jit", ulp=ulp_diff(
            [np.asarray(x) for x in jax.tree.leaves(u)], ref_u))
        p = eqx_offload.filter_jit(
            lambda g, s, p: optax.apply_updates(p, off.update(g, s, p)[0]))(grads, ostate, params)
        emit(exp="update", case=f"{mode}-update+apply-jit", ulp=ulp_diff(
            [np.asarray(x) for x in jax.tree.leaves(p)], ref_p))
    # state fetched by hand from host: the JAX tutorial's pattern
    hstate = eqx_offload.to_host(state)
    manual = jax.jit(lambda g, s, p: optax.apply_updates(
        p, inner.update(g, jax.device_put(s, jax.memory.Space.Device), p)[0]))
    p = manual(grads, hstate, params)
    emit(exp="update", case="manual-fetch-update+apply-jit", ulp=ulp_diff(
        [np.asarray(x) for x in jax.tree.leaves(p)], ref_p))
    # the same split as the offloaded step: update in one program, apply in another
    u, _ = jax.jit(inner.update)(grads, state, params)
    p = jax.jit(optax.apply_updates)(params, u)
    emit(exp="update", case="split-update|apply-jit", ulp=ulp_diff(
        [np.asarray(x) for x in jax.tree.leaves(p)], ref_p))


def run(mode, width, depth, steps, donate=True, highest=False):
    """One mode in a process of its own: losses, step times, device peak and host RSS."""
    before = rss()
    marks = {}
    losses, seconds, _, kinds, rss_steps = train(mode, width, depth, steps, donate, None, marks)
    peak, in_use = peak_device()
    state_bytes = 2 * 4 * (depth + 1) * (width * width + width)
    emit(exp="run", mode=mode, width=width, depth=depth, donate=donate, highest=highest,
         losses=[repr(v) for v in losses], step_ms=[round(s * 1e3, 2) for s in seconds],
         kinds=kinds, device_peak=peak, device_in_use=in_use, rss_before=before["VmRSS"], **marks,
         rss_steps=rss_steps, rss_peak=rss()["VmHWM"], state_bytes=state_bytes)


def copies(mib):
    """Host<->device copy speeds: fresh destinations and reused (donated) ones, eager
    and jitted."""
    n = mib * 2**20 // 4
    dev = jax.random.normal(jax.random.key(0), (n,))
    s_dev = dev.sharding
    s_host = s_dev.with_memory_kind("pinned_host")
    s_unp = s_dev.with_memory_kind("unpinned_host")
    nbytes = n * 4

    def timed(label, fn, reps=5):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            r = fn()
            jax.block_until_ready(r)
            ts.append(time.perf_counter() - t)
            del r
        emit(exp="copy", case=label, mib=mib, gbps=[round(nbytes / t / 1e9, 2) for t in ts])

    timed("d2h device_put pinned", lambda: jax.device_put(dev, s_host))
    timed("d2h device_put unpinned", lambda: jax.device_put(dev, s_unp))
    host = jax.device_put(dev, s_host)
    jax.block_until_ready(host)
    timed("h2d device_put", lambda: jax.device_put(host, s_dev))
    to_host = jax.jit(lambda x: x, out_shardings=s_host)
    timed("d2h jit fresh", lambda: to_host(dev))
    to_dev = jax.jit(lambda x: x, out_shardings=s_dev)
    timed("h2d jit", lambda: to_dev(host))
    # write into a donated host buffer: d2h into memory already touched
    into = jax.jit(lambda h, d: d, out_shardings=s_host, donate_argnums=0)
    box = [jax.device_put(dev, s_host)]
    jax.block_until_ready(box)

    def reuse():
        box[0] = into(box[0], dev)
        return box[0]
    timed("d2h jit into donated host buffer", reuse)
    # both directions at once in one program
    both = jax.jit(lambda h, d: (jax.device_put(h, jax.memory.Space.Device) + 0,
                                 jax.device_put(d * 1, jax.memory.Space.Host)))
    timed("h2d+d2h jit (each direction this size)", lambda: both(host, dev))
    emit(exp="copy-deleted", donated_host_deleted=None)


def determinism(width, depth):
    """Is one compiled plain step reproducible, and does recompiling or donating change
    its result?"""
    model, batch = model_and_data(width, depth)
    inner = optax.adamw(1e-3)
    state = inner.init(eqx.filter(model, eqx.is_array))
    fn = make_step(inner)
    step = eqx.filter_jit(fn)
    runs = [params_np(step(model, state, batch)[0]) for _ in range(3)]
    emit(exp="determinism", case="same program, 3 runs",
         ulp=[ulp_diff(r, runs[0]) for r in runs[1:]])
    jax.clear_caches()
    again = params_np(eqx.filter_jit(fn)(model, state, batch)[0])
    emit(exp="determinism", case="recompiled", ulp=ulp_diff(again, runs[0]))
    def copy(t):
        return jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, t)
    donated = params_np(eqx.filter_jit(fn, donate="all")(copy(model), copy(state), batch)[0])
    emit(exp="determinism", case="donated", ulp=ulp_diff(donated, runs[0]))
    grads = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, batch)
    with_grads = eqx.filter_jit(lambda m, b: eqx.filter_value_and_grad(loss_fn)(m, b))
    emit(exp="determinism", case="grad alone vs value_and_grad", ulp=ulp_diff(
        [np.asarray(x) for x in jax.tree.leaves(grads)],
        [np.asarray(x) for x in jax.tree.leaves(with_grads(model, batch)[1])]))
    # the gradients as an output of the plain step against the gradients alone
    def step_and_grads(model, state, batch):
        loss, g = eqx.filter_value_and_grad(loss_fn)(model, batch)
        u, state = inner.update(g, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, u), state, g
    _, _, g2 = eqx.filter_jit(step_and_grads)(model, state, batch)
    emit(exp="determinism", case="grad alone vs grads out of the step", ulp=ulp_diff(
        [np.asarray(x) for x in jax.tree.leaves(grads)],
        [np.asarray(x) for x in jax.tree.leaves(g2)]))


def floor(width, depth):
    """The bare copies of an AdamW state each way inside jit: to the device (fresh device
    buffers), to host into fresh host buffers, and into donated host buffers."""
    model, _ = model_and_data(width, depth)
    state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array))
    leaves = [x for x in jax.tree.leaves(state) if x.ndim]
    nbytes = sum(x.nbytes for x in leaves)
    host = jax.device_put(leaves, [x.sharding.with_memory_kind("pinned_host") for x in leaves])
    jax.block_until_ready(host)
    Host, Device = jax.memory.Space.Host, jax.memory.Space.Device
    to_dev = jax.jit(lambda h: jax.device_put(h, Device))
    fresh = jax.jit(lambda d: jax.device_put(d, Host))
    into = jax.jit(lambda h, d: jax.device_put(d, Host), donate_argnums=0)
    rt = jax.jit(lambda h: jax.device_put([x * 1 for x in jax.device_put(h, Device)], Host),
                 donate_argnums=0)

    def timed(label, fn, reps=5):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t)
        emit(exp="floor", case=label, width=width, depth=depth, bytes=nbytes,
             ms=[round(t * 1e3, 1) for t in ts], gbps=[round(nbytes / t / 1e9, 2) for t in ts])

    timed("to device (jit)", lambda: to_dev(host))
    timed("to host, fresh buffers (jit)", lambda: fresh(leaves))
    box = [jax.device_put(leaves, [x.sharding for x in host])]
    box[0] = jax.device_put(box[0], [x.sharding for x in host])
    before = box[0][0].unsafe_buffer_pointer()

    def reuse():
        box[0] = into(box[0], leaves)
        return box[0]
    timed("to host, into donated buffers (jit)", reuse)
    emit(exp="floor", case="donated buffer reused", same=box[0][0].unsafe_buffer_pointer() == before)
    box2 = [host]

    def roundtrip():
        box2[0] = rt(box2[0])
        return box2[0]
    timed("round trip, donated (jit)", roundtrip)
    emit(exp="rss", **rss())


def main(argv):
    what = argv[0]
    highest = "highest" in argv
    if highest:
        jax.config.update("jax_default_matmul_precision", "highest")
    emit(exp="env", jax=jax.__version__, device=str(jax.devices()[0].device_kind),
         memories=[m.kind for m in jax.devices()[0].addressable_memories()])
    if what == "bitwise":
        bitwise(int(argv[1]), int(argv[2]), int(argv[3]), highest)
    elif what == "run":
        run(argv[1], int(argv[2]), int(argv[3]), int(argv[4]),
            "keep" not in argv, highest)
    elif what == "determinism":
        determinism(int(argv[1]), int(argv[2]))
    elif what == "floor":
        floor(int(argv[1]), int(argv[2]))
    elif what == "copies":
        copies(int(argv[1]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
