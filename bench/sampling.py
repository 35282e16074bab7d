#!/usr/bin/env python
"""Sampled against greedy decode steps of the real runner, side by side (issue 30 item 1;
goal: a sampled step within 1.2x of a greedy one at batch 1 and 64).

Each setting runs the same all-decode batch (`decode_step.decode_batch`: `--batch`
sequences at `--context` tokens over a cache of random values) through `runner.execute`,
the call the engine makes per step (host metadata, transfer, the jitted step with its
sampling, token read-back), so a ratio is what a client's inter-token latency sees. The
settings take turns, repeat after repeat, so a change in the machine's load hits them
alike. Settings: greedy; plain temperature (what guidellm and the OpenAI SDK send by
default); top-k 50; top-p 0.9; both.

    python bench/sampling.py [--model smollm2-135m] [--batches 1 64] [--context 256]
                             [--repeats 10] [--output FILE]

Run it with another checkout's jserve first on PYTHONPATH for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import numpy as np
from decode_step import decode_batch
from device_timing import device_name, results_tag, today

import jserve
from jserve.engine.batch import Batch
from jserve.models.loading import load_model
from jserve.runners.jax_runner import JaxRunner

RESULTS = pathlib.Path(__file__).parent / "results"
GOAL = 1.2
# name: (temperature, top_k, top_p)
SETTINGS = {
    "greedy": (0.0, 0, 1.0),
    "temperature 1": (1.0, 0, 1.0),
    "top-k 50": (1.0, 50, 1.0),
    "top-p 0.9": (1.0, 0, 0.9),
    "top-k 50 + top-p 0.9": (1.0, 50, 0.9),
}


def with_sampling(batch: Batch, temperature: float, top_k: int, top_p: float) -> Batch:
    """`batch` with every sequence sampling under these settings, seeded apart."""
    n = batch.num_seqs
    x = batch.inputs
    inputs = x.__class__(**{**vars(x), "temperature": np.full(n, temperature, np.float32),
                            "top_k": np.full(n, top_k, np.int32),
                            "top_p": np.full(n, top_p, np.float32),
                            "seeds": np.arange(n, dtype=np.uint32)})
    return Batch(**{**vars(batch), "inputs": inputs})


def time_settings(runner: JaxRunner, batch: Batch, repeats: int) -> dict[str, float]:
    """Median seconds of `runner.execute` per setting, the settings taking turns."""
    batches = {name: with_sampling(batch, *s) for name, s in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for name, b in batches.items():  # compile, and a first run outside the timing
        runner.execute(b)
    for _ in range(repeats):
        for name, b in batches.items():
            t0 = time.perf_counter()
            runner.execute(b)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/sampling_<device>.json)")
    args = ap.parse_args()
    loaded = load_model(args.model)
    cfg = loaded.config
    per_seq = -(-args.context // args.block_size)
    rng = np.random.default_rng(0)
    rows = []
    for batch_size in args.batches:
        num_blocks = batch_size * per_seq + 1
        runner = JaxRunner(loaded.model, num_blocks=num_blocks, block_size=args.block_size,
                           max_num_batched_tokens=batch_size, max_num_seqs=batch_size,
                           max_model_len=per_seq * args.block_size)
        shape = runner.cache.k[0].shape
        dtype = runner.cache.k[0].dtype
        for i in range(cfg.num_layers):
            runner.cache.k[i] = jax.random.normal(jax.random.key(2 * i), shape, dtype)
            runner.cache.v[i] = jax.random.normal(jax.random.key(2 * i + 1), shape, dtype)
        batch = decode_batch(batch_size, args.context, args.block_size, num_blocks,
                             cfg.vocab_size, rng)
        seconds = time_settings(runner, batch, args.repeats)
        greedy = seconds["greedy"]
        print(f"\nbatch {batch_size}, context {args.context} ({args.model}, {device_name()}):")
        for name, s in seconds.items():
            ratio = s / greedy
            verdict = "" if name == "greedy" else ("  PASS" if ratio <= GOAL else "  MISS")
            print(f"  {name:24s} {s * 1e3:9.2f} ms  {ratio:5.2f}x greedy{verdict}")
            rows.append({"batch": batch_size, "setting": name, "seconds": s, "over_greedy": ratio})
        del runner
    result = {"date": today(), "device": device_name(), "model": args.model,
              "context": args.context, "repeats": args.repeats, "goal_over_greedy": GOAL,
              "jserve": str(pathlib.Path(jserve.__file__).parent),
              "load_average": os.getloadavg()[0], "jax_version": jax.__version__, "rows": rows}
    out = pathlib.Path(args.output or RESULTS / f"sampling_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
