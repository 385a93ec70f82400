"""One row of a benchmark table: the project's Llama in one mode (`harness.MODES`), made
where each array lives (`eqx_offload.filter_make`) and trained on one batch of random
tokens. One process per row (the device's peak cannot be reset within one):

    python bench/train.py MODE WIDTH LAYERS [STEPS] [SEQ] [BATCH] [--micro K] [--file NAME]

STEPS (default 20) optimizer steps at sequence SEQ (1024) and batch BATCH (4); with
`--micro K`, each sums the gradients of K micro-batches in a scan and updates once.
Prints a progress line a step and one JSON record (`harness.record`, appended to
$OUT/NAME.jsonl when OUT is set; NAME defaults to `capacity`): the seconds of the
start-up and of each step, tokens a second, the losses, the bytes stored by memory kind.
It stops stepping before it would pass ROW_SECONDS (set by `bench/tpu/next.sh`), so that
a row reports the steps it ran rather than being killed.
"""

import argparse
import json
import os
import sys
import time
from typing import Any

import jax

import eqx_offload

sys.path.insert(0, os.path.dirname(__file__))
import harness  # (bench/)


STARTED = time.perf_counter()


def main(name: str, width: int, layers: int, steps: int = 20, seq: int = 1024,
         batch: int = 4, micro: int = 1) -> dict[str, Any]:
    shape = harness.llama_shape(width, layers, seq, batch)
    row: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                           "seq": seq, "batch": batch, "micro_batches": micro,
                           "tokens_per_step": micro * batch * seq,
                           "backend": jax.default_backend()}
    start, grad_step = harness.trainer(shape, name)
    began = time.perf_counter()
    model, state = jax.block_until_ready(eqx_offload.filter_make(start, jax.random.key(0)))
    row.update(startup_s=time.perf_counter() - began, stored=harness.bytes_by_kind((model, state)),
               resident_after_startup=harness.resident())

    def progress(losses: list[float], times: list[float]) -> None:
        print(json.dumps({**row, "losses": losses, "step_s": times, "phase": f"step {len(times)}",
                          "resident": harness.resident()}), flush=True)

    progress([], [])
    seconds = float(os.environ.get("ROW_SECONDS", "inf")) - (time.perf_counter() - STARTED)
    model, state, losses, times = harness.train(
        harness.step_of(grad_step, micro), model, state, harness.tokens_of(shape, micro),
        steps, seconds, progress)
    return harness.record(**row, losses=losses, step_s=times, falls=losses[-1] < losses[0],
                          **harness.timing(times, row["tokens_per_step"]))


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments: `mode` (read by `harness.mode_of`), `numbers`
    (WIDTH LAYERS and up to STEPS SEQ BATCH), `micro` and `file`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode")
    parser.add_argument("numbers", type=int, nargs="+", metavar="WIDTH LAYERS [STEPS SEQ BATCH]")
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--file", default="capacity")
    args = parser.parse_args(argv)
    if not 2 <= len(args.numbers) <= 5:
        parser.error("give WIDTH LAYERS, then up to STEPS SEQ BATCH")
    try:
        harness.mode_of(args.mode)  # (an unknown mode fails here, before JAX starts)
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    width, layers, *rest = args.numbers
    harness.run_row(args.file, {"mode": args.mode, "width": width, "layers": layers},
                    lambda: main(args.mode, width, layers, *rest, micro=args.micro))
