#!/usr/bin/env python
"""Sampled against greedy decode steps of the real runner, side by side (issue 30 item 1;
goal: a sampled step within 1.2x of a greedy one at batch 1 and 64).

Each setting runs the same all-decode batch (`decode_step.decode_batch`: as many sequences
as the batch, at `--context` tokens, over a cache of random values) through
`runner.execute`, the call the engine makes per step (host metadata, transfer, the jitted
step with its sampling, token read-back), so a ratio is what a client's inter-token latency
sees over such logits. The
settings take turns, repeat after repeat, so a change in the machine's load hits them
alike. Settings: greedy; plain temperature (what guidellm and the OpenAI SDK send by
default); top-k 50; top-p 0.9; both.

The random cache gives near-flat logits, whose 0.9 nucleus is wider than the sampler's
candidates, so top-p there always takes its slowest path (a bisection over the whole row).
A real model's logits are mostly peaked. So the bench then also times what a client sees:
`LLM.generate` of as many real ShareGPT prompts as the batch, `--served-tokens` tokens each
(EOS ignored), and the inter-token latency of the steps in which every request of the batch
decodes (the prefills left out), per setting, the settings again taking turns.

    python bench/sampling.py [--model smollm2-135m] [--batches 1 64] [--context 256]
                             [--repeats 10] [--served-tokens 32] [--served-repeats 2]
                             [--output FILE]

Run it with another checkout's jserve first on PYTHONPATH for a before/after.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import pathlib
import statistics

import jax
import numpy as np
from decode_step import add_decode_batch_args, decode_batch, decode_runner
from device_timing import device_name, random_cache, results_tag, today, turn_about_medians

import jserve
from jserve.benchmarking.workload import sample_lengths
from jserve.engine.batch import Batch, BatchDelta
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
    x = batch.inputs
    delta = BatchDelta.of_sequences(batch.seq_ids, [t for _, t in x.delta.tables.values()],
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=np.arange(batch.num_seqs))
    return dataclasses.replace(batch, inputs=dataclasses.replace(x, delta=delta))


def time_settings(runner: JaxRunner, batch: Batch, repeats: int) -> dict[str, float]:
    """Median seconds of `runner.execute` per setting, the settings taking turns."""
    return turn_about_medians({name: functools.partial(runner.execute, with_sampling(batch, *s))
                               for name, s in SETTINGS.items()}, repeats)


def served_itl(llm: jserve.LLM, prompts: list[str], tokens: int, repeats: int) -> dict[str, float]:
    """Median inter-token latency per setting of `llm.generate(prompts)`, over the token
    gaps that start once every request has its first token: all-decode steps, as in a
    steady stream. The first round (compiling) is not counted."""
    def gaps(setting: str) -> list[float]:
        temperature, top_k, top_p = SETTINGS[setting]
        params = [jserve.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                        max_tokens=tokens, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        decoding = max(o.metrics.first_token_time for o in outs)
        return [b - a for o in outs for a, b in itertools.pairwise(o.metrics.token_times)
                if a >= decoding]

    for setting in SETTINGS:
        gaps(setting)
    measured: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(repeats):
        for setting in SETTINGS:
            measured[setting] += gaps(setting)
    return {name: statistics.median(g) for name, g in measured.items()}


def report(title: str, seconds: dict[str, float], rows: list[dict], **key: object) -> None:
    """Print one batch's settings against greedy and add them to `rows`."""
    greedy = seconds["greedy"]
    print(f"\n{title}:")
    for name, s in seconds.items():
        ratio = s / greedy
        verdict = "" if name == "greedy" else ("  PASS" if ratio <= GOAL else "  MISS")
        print(f"  {name:24s} {s * 1e3:9.2f} ms  {ratio:5.2f}x greedy{verdict}")
        rows.append({**key, "setting": name, "seconds": s, "over_greedy": ratio})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_batch_args(ap, repeats=10)
    ap.add_argument("--served-tokens", type=int, default=32,
                    help="tokens per request of the served part (0: skip it)")
    ap.add_argument("--served-repeats", type=int, default=2, help="rounds of the served part")
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/sampling_<device>.json)")
    args = ap.parse_args()
    loaded = load_model(args.model)
    cfg = loaded.config
    rng = np.random.default_rng(0)
    rows = []
    for batch_size in args.batches:
        runner, num_blocks = decode_runner(loaded, batch_size, args.context, args.block_size)
        runner.cache = random_cache(runner.cache)
        batch = decode_batch(batch_size, args.context, args.block_size, num_blocks,
                             cfg.vocab_size, rng)
        seconds = time_settings(runner, batch, args.repeats)
        report(f"batch {batch_size}, context {args.context}, random cache ({args.model}, {device_name()})",
               seconds, rows, batch=batch_size)
        del runner
    if args.served_tokens:
        prompts = [text for _, _, text in sample_lengths(
            "sharegpt", max(args.batches), seed=0, max_total_len=args.context, output_len=args.served_tokens)]
        for batch_size in args.batches:
            llm = jserve.LLM(loaded, max_num_seqs=batch_size, warmup=False)
            seconds = served_itl(llm, prompts[:batch_size], args.served_tokens, args.served_repeats)
            report(f"served: batch {batch_size}, ShareGPT prompts, inter-token latency ({args.model})",
                   seconds, rows, batch=batch_size, part="served")
            del llm
    result = {"date": today(), "device": device_name(), "model": args.model,
              "context": args.context, "repeats": args.repeats, "goal_over_greedy": GOAL,
              "served_tokens": args.served_tokens, "served_repeats": args.served_repeats,
              "jserve": str(pathlib.Path(jserve.__file__).parent),
              "load_average": os.getloadavg()[0], "jax_version": jax.__version__, "rows": rows}
    out = pathlib.Path(args.output or RESULTS / f"sampling_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
