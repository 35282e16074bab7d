#!/usr/bin/env python
"""Top-p cutoffs over a real model's logits: how many rows the sampler's candidates settle,
and what the CPU's per-pass skip saves (issue 30 item 1).

The sampler looks for a row's top-k/top-p cutoff among its `CANDIDATES` largest logits and
bisects over the whole row where the nucleus is wider (`jserve/runners/sampling.py`). A batch
bisects when any row needs it, so at batch 64 it nearly always does; on a CPU it bisects a few
rows a pass, and a pass whose rows the candidates settled skips its bisection. The rows here
are SmolLM2's logits for the token after each of `--rows` ShareGPT prompts (the dense
reference, its real GGUF weights), each at top-p `--top-p`. Timed, turn about: the
candidates alone; the bisection of every pass (what the batch paid before the skip); the
cutoffs as the sampler finds them now. The cutoffs are checked equal both ways first.

    python bench/sampling_cutoffs.py [--rows 64] [--top-p 0.9] [--repeats 20] [--output FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import device_name, results_tag, today, turn_about_medians

from jserve.benchmarking.workload import sample_lengths
from jserve.models.dense_reference import dense_logits
from jserve.models.gguf_loader import load_llama_gguf
from jserve.models.loading import _REAL_WEIGHTS
from jserve.models.tokenizer import Tokenizer
from jserve.runners.jax_runner import rows_per_pass
from jserve.runners.sampling import CANDIDATES, _bisected_cutoffs, _cutoffs

RESULTS = pathlib.Path(__file__).parent / "results"
MODEL = "smollm2-135m"


def next_token_logits(rows: int) -> np.ndarray:
    """[rows, vocab]: SmolLM2's logits after each of `rows` ShareGPT prompts."""
    path = _REAL_WEIGHTS[MODEL]()
    hparams, weights = load_llama_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    prompts = [text for _, _, text in sample_lengths("sharegpt", rows, seed=0, max_total_len=256, output_len=16)]
    return np.stack([dense_logits(hparams, weights, np.asarray(tokenizer.encode(p)))[-1] for p in prompts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output", default=None, help="JSON path (default: bench/results/sampling_cutoffs_<device>.json)")
    args = ap.parse_args()
    x = jnp.asarray(next_token_logits(args.rows))
    rows, vocab = x.shape
    k = jnp.full(rows, vocab, jnp.int32)
    top_p = jnp.full(rows, args.top_p, jnp.float32)
    every, no_cut = jnp.ones(rows, bool), jnp.zeros(rows, bool)
    mass = np.asarray(jax.lax.top_k(jax.nn.softmax(x, axis=-1), CANDIDATES)[0].sum(-1))
    wide = int((mass < args.top_p).sum())
    per_pass = rows_per_pass(jax.default_backend())
    now = jax.jit(functools.partial(_cutoffs, rows_per_pass=per_pass))
    bisect = jax.jit(functools.partial(_bisected_cutoffs, rows_per_pass=per_pass))
    np.testing.assert_array_equal(np.asarray(now(x, k, top_p, every)), np.asarray(bisect(x, k, top_p)))
    runs = {"candidates alone": lambda: now(x, k, top_p, no_cut),
            "every pass bisecting": lambda: bisect(x, k, top_p),
            "cutoffs now": lambda: now(x, k, top_p, every)}
    ms = {name: s * 1e3 for name, s in turn_about_medians(runs, args.repeats).items()}
    before = ms["candidates alone"] + ms["every pass bisecting"]
    print(f"{rows} rows of {MODEL}'s next-token logits ({device_name()}, {per_pass or 'all'} rows a pass): "
          f"{wide} with a {args.top_p} nucleus wider than the {CANDIDATES} candidates")
    for name, v in ms.items():
        print(f"  {name:24s} {v:7.1f} ms")
    print(f"  before the skip (candidates, then every pass bisecting) {before:.1f} ms; now {ms['cutoffs now']:.1f} ms "
          f"({before / ms['cutoffs now']:.2f}x)")
    out = pathlib.Path(args.output or RESULTS / f"sampling_cutoffs_{results_tag()}.json")
    out.write_text(json.dumps({"date": today(), "device": device_name(), "model": MODEL, "rows": rows,
                               "top_p": args.top_p, "wider_than_candidates": wide, "rows_per_pass": per_pass,
                               "median_ms": ms, "before_ms": before}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
