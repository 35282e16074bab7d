#!/usr/bin/env python
"""Decoding under a JSON schema against unconstrained sampling, side by side (issue 44;
goal: a constrained decode step within 1.3x of an unconstrained one at batch 1 and 32).

Each setting runs `LLM.generate` of as many real ShareGPT prompts as the batch, sampled at
temperature 1, `--tokens` tokens each, and times the decode steps that follow once every
request of the batch has its first token (the prefills left out): the gap between a
request's consecutive tokens, which is the engine's step as a client sees it. Unconstrained
requests ignore EOS; constrained ones follow `SCHEMA`, a list of at least `MIN_ITEMS`
people, so they too run to `--tokens` (checked). A constrained step pays for its grammar
three ways, all counted: llguidance computing each row's token bitmask on the host, the
mask applied to the logits on the device, and the loop running in step (not pipelined)
while a grammar request is live. The settings take turns, round after round, so a change
in the machine's load hits them alike; the first round (compiling) is not counted.

    python bench/structured_outputs.py [--model smollm2-135m] [--batches 1 32]
                                       [--tokens 64] [--repeats 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics

import jax
from device_timing import device_name, results_tag, today

import jserve
from jserve.benchmarking.workload import sample_lengths
from jserve.models.loading import load_model
from jserve.structured import GrammarSpec

RESULTS = pathlib.Path(__file__).parent / "results"
GOAL = 1.3
CONTEXT = 256  # prompt + output tokens of a request, at most
BLOCK = 16
MIN_ITEMS = 100  # more people than `--tokens` can hold: every request ends by length
SCHEMA = {"type": "array", "minItems": MIN_ITEMS, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}}}}
SETTINGS = {"unconstrained": None, "json_schema": GrammarSpec.json_schema(SCHEMA)}


def decode_gaps(llm: jserve.LLM, prompts: list[str], tokens: int, grammar: GrammarSpec | None) -> list[float]:
    """The token gaps of one `generate`'s all-decode steps."""
    params = [jserve.SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, grammar=grammar,
                                    ignore_eos=grammar is None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if any(len(o.token_ids) != tokens for o in outs):
        raise RuntimeError("a request ended before --tokens: the settings' steps would differ")
    if grammar is not None and not all(o.text.startswith('[{"name": "') for o in outs):
        raise RuntimeError("a constrained output does not follow the schema")
    decoding = max(o.metrics.first_token_time for o in outs)
    return [b - a for o in outs for a, b in itertools.pairwise(o.metrics.token_times) if a >= decoding]


def step_medians(llm: jserve.LLM, prompts: list[str], tokens: int, repeats: int) -> dict[str, float]:
    for grammar in SETTINGS.values():  # compiling, and llguidance's token table
        decode_gaps(llm, prompts, tokens, grammar)
    gaps: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(repeats):
        for name, grammar in SETTINGS.items():
            gaps[name] += decode_gaps(llm, prompts, tokens, grammar)
    return {name: statistics.median(g) for name, g in gaps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="rounds after the first")
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/structured_outputs_<device>.json)")
    args = ap.parse_args()
    loaded = load_model(args.model)
    prompts = [text for _, _, text in sample_lengths("sharegpt", max(args.batches), seed=0,
                                                     max_total_len=CONTEXT, output_len=args.tokens)]
    rows = []
    for batch in args.batches:
        llm = jserve.LLM(loaded, max_num_seqs=batch, warmup=False, max_model_len=CONTEXT,
                         num_blocks=batch * CONTEXT // BLOCK + 1, block_size=BLOCK)
        seconds = step_medians(llm, prompts[:batch], args.tokens, args.repeats)
        ratio = seconds["json_schema"] / seconds["unconstrained"]
        print(f"batch {batch:3d} ({args.model}, {device_name()}): unconstrained "
              f"{seconds['unconstrained'] * 1e3:8.2f} ms, json_schema {seconds['json_schema'] * 1e3:8.2f} ms "
              f"a step: {ratio:.2f}x (goal {GOAL}x) {'PASS' if ratio <= GOAL else 'MISS'}")
        rows.append({"batch": batch, **{f"{k}_s": v for k, v in seconds.items()}, "ratio": ratio})
        del llm
    result = {"date": today(), "device": device_name(), "model": args.model, "tokens": args.tokens,
              "repeats": args.repeats, "goal": GOAL, "schema": SCHEMA,
              "load_average": os.getloadavg()[0], "jax_version": jax.__version__, "rows": rows}
    out = pathlib.Path(args.output or RESULTS / f"structured_outputs_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
