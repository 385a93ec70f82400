"""`gpu_plan` of abstract arguments, the loop counts, collectives and floors it reads from
XLA's plan (for an H100, compiled on the CPU: not measurements), and the capacity search
(`python bench/capacity_run.py`) on a small ladder. Needs the GPU compiler."""

import argparse
import json
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload
from eqx_offload._plan import deviceless as _deviceless
from helpers import gpu_plan_marks


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import capacity  # (bench/: scripts of the repository, not of the package)
import capacity_batch
import capacity_run
import harness
import llama


pytestmark = gpu_plan_marks()


def test_abstract_arguments_plan_as_their_arrays_or_fail_clearly():
    """Abstract arguments plan as their arrays; one without a usable sharding is an error."""
    model = eqx.nn.MLP(256, 256, 256, 3, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=1 << 18)

    @eqx_offload.filter_jit(donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    state, x = opt.init(eqx.filter(model, eqx.is_array)), jnp.ones((64, 256))
    concrete = eqx_offload.planner.gpu_plan(step, model, state, x, target="h100")
    abstract_model = eqx_offload.checkpoint.filter_eval_shape(
        lambda: eqx.nn.MLP(256, 256, 256, 3, key=jax.random.key(0)))
    abstract_state = eqx_offload.checkpoint.filter_eval_shape(
        lambda m: opt.init(eqx.filter(m, eqx.is_array)), abstract_model)
    abstract_x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    assert abstract_state.inner_state[0].mu.layers[0].weight.sharding.memory_kind == "pinned_host"
    abstract = eqx_offload.planner.gpu_plan(step, abstract_model, abstract_state, abstract_x,
                                    target="h100")
    for field in ("device_peak_bytes", "argument_bytes", "temp_bytes", "host_bytes",
                  "copies", "matmul_flops"):
        assert getattr(abstract, field) == getattr(concrete, field), field
    assert concrete.copies_to("to_device") and concrete.host_bytes > 0
    # Floors: forward and backward flops (3 x the forward's) at TF32; the state crosses both ways.
    forward = 2 * 64 * (4 * 256 * 256)
    assert concrete.matmul_flops == {"tf32": pytest.approx(3 * forward - 2 * 64 * 256 * 256)}
    assert concrete.bytes_moved("to_device") == concrete.bytes_moved("to_host") > 0
    floor = concrete.bytes_moved("to_device") / 64e9
    assert concrete.transfer_floor_seconds == pytest.approx(floor) and concrete.floor_ratio >= 1.0
    assert "floors (lower bounds, not predictions)" in concrete.summary()
    with pytest.raises(eqx_offload.errors.PlanError, match=r"args\[2\] \(float32\[64, 256\]\) has no "
                                                    r"sharding.*restore_target"):
        eqx_offload.planner.gpu_plan(step, model, state, jax.ShapeDtypeStruct((64, 256), jnp.float32))
    topology = _deviceless.topology(eqx_offload.planner.GPU_TARGETS["h100"].config_text(), 1)
    elsewhere = jax.sharding.make_single_device_sharding(topology.devices[0])
    with pytest.raises(eqx_offload.errors.PlanError, match=r"args\[2\].*not this process's"):
        eqx_offload.planner.gpu_plan(step, model, state,
                             jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=elsewhere))
    with pytest.raises(eqx_offload.errors.OptionError, match="host_memory"):
        eqx_offload.planner.gpu_plan(step, model, state, jnp.ones((64, 256)), host_memory=-1)


def test_matmul_flops_count_every_iteration():
    from eqx_offload._plan.flops import matmul_flops

    w, x = jnp.ones((6, 32, 32)), jnp.ones((8, 32))

    def scanned(w, x):
        return jax.lax.scan(lambda x, w: (x @ w, None), x, w)[0]

    def branch(p, x):
        return jax.lax.cond(p, lambda x: x @ x.T @ x, lambda x: x, x)

    assert matmul_flops(jax.make_jaxpr(scanned)(w, x)) == {"tf32": 6 * 2 * 8 * 32 * 32}
    assert matmul_flops(jax.make_jaxpr(branch)(True, x)) == {
        "tf32": 2 * 8 * 32 * 8 + 2 * 8 * 8 * 32}
    bf16 = jax.make_jaxpr(scanned)(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
    assert matmul_flops(bf16) == {"bf16": 6 * 2 * 8 * 32 * 32}


@pytest.mark.parametrize("start,first,never", [
    (None, [], []), (0, [0], []), (5, [5], []), (6, [6], []), (9, [9], []),
    ([8, 5, 2], [8, 5], [2])])
def test_largest_fitting_bisects_from_a_guess(start, first, never):
    """Guesses (other modes' answers) go first, largest down; right or wrong, the same answer."""
    asked = []

    def fits(n):
        asked.append(n)
        return n <= 5

    index, answers = capacity.largest_fitting(list(range(10)), fits, start)
    assert index == 5 and answers[5] and not answers[6]
    assert asked[:len(first)] == first and len(asked) <= len(first[:1]) + 4
    assert not set(never) & set(asked)
    assert capacity.largest_fitting([3, 4], lambda n: False, start)[0] is None


def test_search_starts_where_a_mode_that_keeps_more_ended():
    ladder = list(llama.ladder())
    point = capacity.CapacityPoint(ladder[3], "state", "h100", 1, 1, 2, 0, 1, 1, True, 0, 0, {},
                                   0.0, 0.0, 0.0, None, 0.0)
    modes = harness.MODES_BY_NAME
    done = [capacity.Capacity(modes["state"], "h100", 1, point, None, (point,))]
    assert capacity_run._start(done, modes["+master"], "h100", 1, ladder) == [3]
    assert capacity_run._start(done, modes["state"], "h200", 1, ladder) == [3]  # more memory
    assert capacity_run._start(done, modes["bf16"], "h100", 1, ladder) == []
    assert capacity_run._start(done, modes["+master"], "h100", 8, ladder) == []


def test_ladder_is_the_published_shapes_and_depths_between():
    shapes = llama.ladder()
    sizes = [s.params for s in shapes]
    assert sizes == sorted(sizes)
    published = {s.name: s.params / 1e9 for s in llama.LLAMA_SHAPES}
    # Meta's counts (billions), with untied embeddings for the Llama 3.2 pair.
    for name, billions in [("Llama 2 7B", 6.74), ("Llama 2 13B", 13.02), ("Llama 3.1 8B", 8.03),
                           ("Llama 3.1 70B", 70.55)]:
        assert published[name] == pytest.approx(billions, abs=0.01), name
    assert len(shapes) == len(llama.LLAMA_SHAPES) * 3 - 2


def test_llama_model_trains():
    shape = llama.LlamaShape("tiny", 32, 2, 4, 2, 64, 50, seq=16)
    model = llama.Llama(shape, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, shape.seq + 1), 0, shape.vocab)
    assert llama.llama_loss(model, tokens).shape == ()
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert sum(x.size for x in leaves) == shape.params
    opt = optax.adamw(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(llama.llama_loss)(model, tokens)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(5):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_capacity_command_quick(tmp_path, capsys, monkeypatch):
    """One H100 cut to 12 MiB, 3 modes, 3 small shapes; a rerun on its cache plans nothing."""
    parser = argparse.ArgumentParser()
    capacity_run.add_capacity_arguments(parser)
    out, cache = tmp_path / "capacity.json", tmp_path / "points.jsonl"
    argv = ["--quick", "--json", str(out), "--cache", str(cache)]
    assert capacity_run.run_capacity(parser.parse_args(argv)) == 0
    printed = capsys.readouterr().out
    planned = len(cache.read_text().splitlines())
    assert planned >= 3

    def no_planning(*args, **kwargs):
        raise AssertionError("planned a point that is in the cache")

    monkeypatch.setattr(capacity, "plan_point", no_planning)
    assert capacity_run.run_capacity(parser.parse_args(argv)) == 0
    assert capsys.readouterr().out == printed
    assert len(cache.read_text().splitlines()) == planned
    assert "| H100 | fp32 |" in printed and "| H100 | +activations |" in printed
    assert "device peak (MiB)" in printed
    rows = [r.split("|") for r in printed.splitlines() if r.startswith("| H100 |")]
    assert len(rows) == 3
    for row in rows:  # the model's size, device peak, host, bytes moved: none reads 0.0
        assert row[4].strip() not in ("", "0.0B") and float(row[5]) > 0, row
    assert all(float(row[6]) > 0 and float(row[7].split("/")[0]) > 0 for row in rows[1:])
    results = {r["mode"]: r for r in json.loads(out.read_text())}
    plain, everything = results["fp32"], results["+activations"]
    assert plain["largest"] is not None and everything["largest"] is not None
    # Everything in host memory trains a deeper model in the same 12 MiB than fp32 does.
    assert everything["largest"]["params"] > plain["largest"]["params"]
    assert any(not p["fits"] for p in plain["planned"])
    largest = everything["largest"]
    assert largest["host_bytes"] > 0 and largest["device_peak_bytes"] <= 12 << 20
    # Each layer's weights come to the device in the forward and again in the backward
    # pass (loop counts, not instructions): more than twice the blocks' bf16 weights.
    shape = llama.LlamaShape(**largest["shape"])
    assert largest["bytes_to_device"] > 2 * shape.layers * shape.block_params * 2
    assert largest["transfer_floor_s"] > 0 and largest["floor_ratio"] >= 1


def test_smallest_batch_is_the_first_power_of_two_within_the_limit():
    """Copies within 10% of 1 s of compute a micro-batch at a power of two of tokens, or never."""
    assert capacity_batch.line(2, 5.0, 4, 9.0) == capacity_batch.Line(1.0, 2.0)
    compute = capacity_batch.Line(0.0, 1.0)
    for per_micro, transfer, smallest in [
            (4096, (2.4, 0.0), 32 * 4096), (4096, (2.5, 0.0), 32 * 4096),
            (4096, (3.3, 0.0), 64 * 4096), (4096, (0.05, 0.0), 4096), (4096, (0.0, 0.11), None),
            (3072, (0.1, 0.0), None), (2048, (0.3, 0.0), 8192)]:
        got = capacity_batch.smallest_batch(per_micro, compute, capacity_batch.Line(*transfer))
        assert got == smallest, (per_micro, transfer)


def test_batch_step_moves_the_state_once_per_optimizer_step():
    """State and master weights cross once per K micro-batches; K = 2 and 4 predict K = 8."""
    shape = capacity_run.QUICK_LADDER[0]
    mode = harness.MODES_BY_NAME["+master"]
    row = capacity_batch.batch_row(shape, mode, 2, "h100")
    eight = capacity_batch.plan_batch_point(shape, mode, 8, "h100")
    points = (row.low, row.high, eight)
    assert [p.micro_batches for p in points] == [2, 4, 8]
    assert all(p.error is None and p.fits for p in points)
    state = 3 * 4 * shape.params  # fp32 master weights and both AdamW moments
    for p in points:
        for moved in (p.bytes_to_device, p.bytes_to_host):
            assert state <= moved <= 1.1 * state, (p.micro_batches, moved, state)
    assert eight.tokens == 8 * shape.seq
    assert eight.matmul_s == pytest.approx(row.compute_s.at(8), rel=1e-9)
    assert row.compute_s.fixed == pytest.approx(0, abs=1e-3 * row.compute_s.per_micro_batch)
    assert eight.transfer_floor_s == pytest.approx(row.transfer_s.at(8), rel=0.02)
    assert "| H100 | +master | tiny 2L | 512 |" in capacity_batch.batch_table([row])


def test_node_plan_shards_the_state_over_the_devices():
    """8 deviceless H100s: FSDP weights, the state offloaded shard by shard, bytes per device."""
    shape = llama.LlamaShape("tiny", 128, 2, 4, 2, 256, 512, seq=64)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    step, args = capacity.training_step(shape, harness.MODES_BY_NAME["+master"], mesh)
    mu = args[1].inner_state.inner_state[0].mu.blocks.mlp.up.weight
    assert mu.sharding.memory_kind == "pinned_host"
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "data", None)
    plan = eqx_offload.planner.gpu_plan(step, *args, target="h100", host_memory=1 << 40)
    assert plan.n_devices == 8
    per_device = 3 * 4 * shape.params / 8  # fp32 master weights and Adam's two moments
    assert per_device * 0.9 < plan.host_bytes < per_device * 1.3
    assert plan.host_total_bytes == 8 * plan.host_bytes and plan.host_fits
    kinds = {c.kind for c in plan.collectives}
    assert {"all-gather", "reduce-scatter"} <= kinds or "all-reduce" in kinds
    assert "x 8 devices" in plan.summary() and "collectives:" in plan.summary()


def test_a_step_whose_arguments_alone_do_not_fit_is_not_compiled(monkeypatch):
    """Where the weights and state alone exceed a memory, the point does not fit, uncompiled."""
    shape = capacity_run.QUICK_LADDER[0]

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a step whose arguments alone do not fit")

    monkeypatch.setattr(eqx_offload, "plan", no_compile)  # (what plan_point calls)
    step, args = capacity.training_step(shape, harness.MODES_BY_NAME["+master"])
    device, host = capacity.argument_bytes(args)
    # bf16 weights (and tokens, counters) on the device; fp32 master weights, mu, nu on the host.
    assert 2 * shape.params < device < 2 * shape.params + 1024
    assert host == 3 * 4 * shape.params
    tight_host = capacity.plan_point(shape, harness.MODES_BY_NAME["+master"], "h100",
                                     host_memory=host - 1)
    assert tight_host.from_arguments and not tight_host.fits
    assert tight_host.host_bytes == host
    assert "not compiled" in capacity_run._why_not(tight_host)
    tight_device = capacity.plan_point(shape, harness.MODES_BY_NAME["fp32"], "h100",
                                       device_memory=3 * 4 * shape.params)
    assert tight_device.from_arguments and not tight_device.fits  # weights, mu, nu, count


BATCH_JSON = pathlib.Path(__file__).parents[2] / "docs/bench/gpu/capacity_batch.json"


def test_published_batch_table_is_the_json():
    """`bench/capacity_run.py --micro-batches`'s JSON is docs/capacity.md's table (the formula's
    table for the other rows: docs/results.md's); the goals hold."""
    rows = json.loads(BATCH_JSON.read_text())
    page = (BATCH_JSON.parent.parent.parent / "capacity.md").read_text()
    assert rows
    for record in rows:
        low, high = (capacity_batch.batch_point_from_record(record[k]) for k in ("low", "high"))
        lines = [None if record[k] is None else capacity_batch.Line(**record[k])
                 for k in ("compute_s", "transfer_s")]
        row = capacity_batch.BatchRow(low, high, *lines, record["smallest_tokens"])
        if row.compute_s is not None:
            per_micro = low.shape.batch * low.shape.seq * low.n_devices
            assert record["smallest_tokens"] == capacity_batch.smallest_batch(
                per_micro, row.compute_s, row.transfer_s)
        [line] = capacity_batch.batch_table([row]).splitlines()[2:]
        assert line in page, line
    # The table by formula alone, from the one-micro-batch plans of capacity.json.
    published = json.loads((BATCH_JSON.parent / "capacity.json").read_text())
    results = (BATCH_JSON.parent.parent.parent / "results.md").read_text()
    for line in capacity_batch.formula_table(published).splitlines():
        assert line in results, line
    # 13B on one H100 and 70B on the node reach 10% at 256k tokens by the floors.
    smallest = {(r["low"]["target"], r["low"]["n_devices"], r["low"]["mode"],
                 r["low"].get("accumulate", "float32"), r["low"].get("accumulate_in", "device"),
                 r["low"]["shape"]["batch"]): r for r in rows}
    assert len(smallest) == len(rows)
    assert smallest[("h100", 1, "+master", "float32", "device", 1)]["smallest_tokens"] <= 1 << 18
    assert smallest[("h100", 8, "+master", "float32", "device", 1)]["smallest_tokens"] <= 1 << 20
    # Gradients in host memory: 13B fits the H100 and never reaches 10% at one sequence a
    # micro-batch; 16 would at 512k tokens, but that micro-batch does not fit.
    for where in ("host", "host-stack"):
        row = smallest[("h100", 1, "+master", "float32", where, 1)]
        assert row["high"]["fits"] and row["smallest_tokens"] is None
    wide = smallest[("h100", 1, "+master", "float32", "host-stack", 16)]
    assert not wide["high"]["fits"] and wide["smallest_tokens"] == 1 << 19


def test_published_capacity_table_is_the_json_and_meets_the_goals():
    """`bench/capacity_run.py`'s JSON is the README's and the GPU plan page's tables; the goals hold."""
    root = pathlib.Path(__file__).parents[2]
    results = json.loads((root / "docs/bench/gpu/capacity.json").read_text())
    best = {(r["target"], r["n_devices"], r["mode"]): r["largest"] for r in results}
    assert len(best) == 3 * len(harness.MODES)
    for largest in best.values():
        assert largest is not None and largest["fits"]
        assert largest["device_peak_bytes"] <= largest["device_memory_bytes"]
        assert largest["host_bytes"] <= largest["host_memory_bytes"]
    # 13B on one H100 within 256 GB of host memory; 70B on an 8 x H100 node.
    assert best[("h100", 1, "+master")]["params"] >= 13e9
    assert best[("h100", 8, "+master")]["params"] >= 70e9
    assert best[("h100", 1, "+activations")]["host_memory_bytes"] == 256 * 10**9
    # With 2 TB of host memory one H100 plans 10 x its plain fp32 model, and 70B.
    large = json.loads((root / "docs/bench/gpu/capacity_large_host.json").read_text())
    assert all(p["fits"] and p["target"] == "h100" and p["n_devices"] == 1 for p in large)
    assert max(p["params"] for p in large) >= 70e9
    assert min(p["params"] for p in large) >= 10 * best[("h100", 1, "fp32")]["params"]

    def cell(key):
        p = best[key]
        return (f"{p['params'] / 1e9:.1f}B ({p['device_peak_bytes'] / 2**30:.0f} / "
                f"{p['host_bytes'] / 2**30:.0f})")

    # The whole table (docs/bench/gpu/capacity.md) is the JSON's, with each row's settings.
    whole = capacity_run.capacity_table(capacity_run.capacity_from_records(results))
    assert whole + "\n" == (root / "docs/bench/gpu/capacity.md").read_text()
    assert "`XLA_CLIENT_MEM_FRACTION=0.90 XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=146`" in whole
    page = (root / "docs/gpu-plan.md").read_text().replace("**", "").replace(" GiB)", ")")
    for gpu, n in (("h100", 1), ("h200", 1), ("h100", 8)):
        for mode in ("fp32", "state", "+master", "+activations"):
            assert cell((gpu, n, mode)) in page, (gpu, n, mode, cell((gpu, n, mode)))
    # The README's and the docs' front page's GPU rows: the largest model, fp32 and +master.
    for front in ("README.md", "docs/index.md"):
        rows = (root / front).read_text().splitlines()
        for label, n in (("one H100 80 GB", 1), ("8 × H100 node", 8)):
            [row] = [r for r in rows if r.startswith("|") and label in r]
            for mode in ("fp32", "+master"):
                params = f"| {best[('h100', n, mode)]['params'] / 1e9:.1f}B |"
                assert params in row, (front, label, mode, params)


def test_a_gradient_sum_in_host_memory_trains_as_one_on_the_device():
    """3 micro-batches summed in host memory (each, or kept and summed once) train bitwise."""
    shape = llama.LlamaShape("tiny", 32, 2, 4, 2, 64, 50, seq=16)
    mw = eqx_offload.master_weights(optax.adamw(1e-2))
    update = harness.builder(harness.mode_of("bf16"), mw).update  # as the table's
    tokens = jax.random.randint(jax.random.key(1), (3, 2, shape.seq + 1), 0, shape.vocab)
    results = {}
    for where in ("device", "host", "host-stack"):  # a fresh model and state: the step donates
        model, state = mw.init(llama.Llama(shape, jax.random.key(0)))
        step = capacity_batch.accumulating_step(update, jnp.float32, where)
        results[where] = jax.tree.leaves(step(model, state, tokens))
    for where in ("host", "host-stack"):
        for a, b in zip(results[where], results["device"], strict=True):
            assert a.sharding.memory_kind == b.sharding.memory_kind
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_gradient_sum_made_in_the_backward_scan_trains_as_the_bf16_sum():
    """3 micro-batches, the blocks' bf16 gradients added inside `scan_layers`' backward scan
    ("device-fused"): bitwise the bf16 sum of whole gradients ("device"); refused (named,
    not compiled) where the blocks' weights wait in host memory."""
    shape = llama.LlamaShape("tiny", 32, 2, 4, 2, 64, 50, seq=16)
    mw = eqx_offload.master_weights(optax.adamw(1e-2))
    update = harness.builder(harness.mode_of("bf16"), mw).update
    tokens = jax.random.randint(jax.random.key(1), (3, 2, shape.seq + 1), 0, shape.vocab)
    results = {}
    for where in ("device", "device-fused"):  # a fresh model and state: the step donates
        model, state = mw.init(llama.Llama(shape, jax.random.key(0)))
        step = capacity_batch.accumulating_step(update, jnp.bfloat16, where)
        results[where] = jax.tree.leaves(step(model, state, tokens))
    for a, b in zip(results["device-fused"], results["device"], strict=True):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    refused = capacity_batch.plan_batch_point(shape, harness.MODES_BY_NAME["+params"], 2,
                                              accumulate_in="device-fused")
    assert not refused.fits and "blocks' weights on the device" in refused.error


def test_a_host_gradient_sum_crosses_as_xla_plans_it():
    """Per micro-batch: kept gradients ("host-stack") cross as their bf16 bytes, nothing to the
    device (the host writes their bf16 mean there once); the host's fp32 sum ("host") is
    written to the device and back: 2 + 4 B a parameter to the host, 4 B to the device."""
    shape, state = capacity_run.QUICK_LADDER[0], 3 * 4 * capacity_run.QUICK_LADDER[0].params
    for where, down, up in (("host-stack", 0, 2), ("host", 4, 6)):
        low, high = (capacity_batch.plan_batch_point(
            shape, harness.MODES_BY_NAME["+master"], k, "h100", accumulate_in=where)
            for k in (2, 4))
        assert low.error is None and low.fits and high.fits
        assert (high.bytes_to_device - low.bytes_to_device) / 2 == down * shape.params, where
        assert (high.bytes_to_host - low.bytes_to_host) / 2 == up * shape.params, where
        if where == "host-stack":
            assert low.bytes_to_device == high.bytes_to_device == state + 2 * shape.params
            assert low.bytes_to_host == state + 4 * shape.params


def test_a_row_prints_the_settings_of_its_plan_summary(monkeypatch):
    """0.001% of the GPU, no pinned pool: the row and its record print the summary's settings."""
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.00001")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0")
    plans, real = [], eqx_offload.plan

    def recording(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]
    monkeypatch.setattr(eqx_offload, "plan", recording)
    mode = harness.MODES_BY_NAME["+master"]
    point = capacity.plan_point(capacity_run.QUICK_LADDER[0], mode, "h100")
    [plan] = plans
    [line] = [x for x in plan.summary().splitlines() if x.startswith("  run with: ")]
    settings = line.removeprefix("  run with: ")
    assert settings.split() == list(point.run_settings) == plan.run_settings()
    assert [s.split("=")[0] for s in point.run_settings] == [
        "XLA_CLIENT_MEM_FRACTION", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]
    assert point.fits and not plan.fits  # fits once run with those settings
    row = capacity.Capacity(mode, "h100", 1, point, None, (point,))
    assert f"| `{settings}` |" in capacity_run.capacity_table([row])
    record = json.loads(json.dumps(capacity.point_record(point)))  # as `--cache` reads it
    assert capacity.point_from_record(record) == point
