#!/usr/bin/env python
"""One decode step of the real runner against its memory roofline, in one run.

A decode step must read every weight once and every sequence's K/V once; at batch 64 that
traffic dwarfs the arithmetic, so its floor is

    roofline = (weight bytes + K/V bytes read + K/V bytes written) / copy bandwidth

with the copy bandwidth measured in the same run (device_timing.copy_bandwidth). The step
is `JaxRunner`'s jit step (model, attention backend, sampling), fed an all-decode batch of
`--batch` sequences, each at `--context` tokens, over shuffled distinct blocks of a cache
filled with random values. Two times are reported: the device step alone (inputs already
on the device), and `runner.execute` (host metadata, transfer and token read-back too).

Defaults: llama-2-7b with dummy weights at batch 64 and context 2048 on GPU (bfloat16;
13.5 GB of weights plus 69 GB of K/V, so it needs an H200-class GPU: on a smaller one it
halves the batch until the cache fits, and says so). On CPU that does not fit in memory,
so the default there is smollm2-135m's shape at context 1024, float32, and the figures are
for the CPU reference path.

It also times the step's attention alone (the decode kernel on one layer's cache with the
step's metadata, times the number of layers), so the gap to the roofline splits into
attention and the rest.

Usage::

    python bench/decode_step.py
    python bench/decode_step.py --model llama-2-7b --batch 32 --context 2048 --attention pallas
    python bench/decode_step.py --decode-params '{"block_k": 32}'   # decode kernel parameters
    python bench/decode_step.py --decode-params-from bench/results/kernels_X.json  # its fastest
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import (
    copy_bandwidth,
    device_name,
    median_seconds,
    on_gpu,
    random_cache,
    random_like,
    results_tag,
    today,
)

from jserve.engine.batch import Batch, BatchDelta, BatchInputs
from jserve.runners.jax_runner import JaxRunner, build_step_inputs
from jserve.runners.packed_inputs import Packed
from jserve.models.loading import load_model
from jserve.pallas_kernels.backends import ATTENTION_BACKENDS, select_attention
from jserve.pallas_kernels.paged_decode_attention import paged_decode_attention

RESULTS = pathlib.Path(__file__).parent / "results"


def decode_batch(batch: int, context: int, block_size: int, num_blocks: int, vocab: int,
                 rng: np.random.Generator) -> Batch:
    """`batch` sequences each decoding the token at position `context - 1`."""
    per_seq = -(-context // block_size)
    ids = rng.permutation(num_blocks)[: batch * per_seq].astype(np.int32)
    inputs = BatchInputs(
        token_ids=rng.integers(0, vocab, batch).astype(np.int32), output_index=np.zeros(batch, np.int32),
        delta=BatchDelta.of_sequences(range(batch), np.split(ids, batch)))
    return Batch(seq_ids=np.arange(batch), start=np.full(batch, context - 1, np.int32),
                 query_lens=np.ones(batch, np.int32), sample=np.ones(batch, bool), inputs=inputs)


def decode_runner(loaded, batch: int, context: int, block_size: int, attention: str = "auto"
                  ) -> tuple[JaxRunner, int]:
    """A runner with room for `batch` sequences of `context` tokens (and the scratch
    block), and its number of blocks, for `decode_batch`."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    return JaxRunner(loaded.model, num_blocks=num_blocks, block_size=block_size,
                     max_num_batched_tokens=batch, max_num_seqs=batch,
                     max_model_len=per_seq * block_size, attention=attention), num_blocks


def add_decode_batch_args(ap, repeats: int) -> None:
    """The options of a script that times steps of `decode_batch` batches on CPU-sized
    settings (bench/penalties.py, bench/sampling.py)."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=repeats)


def fits(cfg, batch: int, context: int, itemsize: int) -> bool:
    """Weights and K/V within 85% of the device's memory (where the backend reports it)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    need = cfg.num_params * itemsize + batch * context * cfg.kv_bytes_per_token // 2 * itemsize
    return limit is None or need < 0.85 * limit


def fastest_decode_params(path: str) -> dict:
    """Launch parameters of the fastest correct variant of our decode kernel in a
    kernels.py results file (its `decode_comparison`)."""
    rows = json.loads(pathlib.Path(path).read_text()).get("decode_comparison", [])
    ours = [r for r in rows if r["kernel"].startswith("ours") and "seconds" in r
            and r["relative_error"] < 1e-2]
    return min(ours, key=lambda r: r["seconds"])["params"] if ours else {}


def with_decode_params(params: dict, base_name: str) -> str:
    """Register a Pallas backend (`base_name` if it is one, else `pallas`) with these
    decode-kernel parameters; returns its name."""
    base_name = base_name if base_name.startswith("pallas") else "pallas"
    base = ATTENTION_BACKENDS[base_name]
    name = base_name + "".join(f" {k}={v}" for k, v in sorted(params.items()))
    ATTENTION_BACKENDS[name] = dataclasses.replace(
        base, name=name, decode=partial(paged_decode_attention, **{**base.decode.keywords, **params}))
    return name


def main() -> None:
    gpu = on_gpu()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-2-7b" if gpu else "smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048 if gpu else 1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    ap.add_argument("--attention", default="auto", help="auto, reference, pallas")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--decode-params", default=None,
                    help="JSON dict of paged_decode_attention parameters (with the pallas backend)")
    ap.add_argument("--decode-params-from", default=None,
                    help="kernels.py results JSON: use its fastest correct decode variant")
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/decode_step_<device>.json)")
    args = ap.parse_args()
    decode_params = None
    if args.decode_params or args.decode_params_from:
        decode_params = (json.loads(args.decode_params) if args.decode_params
                         else fastest_decode_params(args.decode_params_from))
        args.attention = with_decode_params(decode_params, args.attention)
        print(f"decode kernel parameters: {decode_params} (backend {args.attention!r})")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    loaded = load_model(args.model, weights="dummy", dtype=dtype)
    cfg = loaded.config
    batch = args.batch
    while batch > 1 and not fits(cfg, batch, args.context, dtype.itemsize):
        batch //= 2
    if batch != args.batch:
        print(f"note: batch {args.batch} x {args.context} tokens does not fit this device; "
              f"measuring batch {batch}")
    runner, num_blocks = decode_runner(loaded, batch, args.context, args.block_size, args.attention)
    runner.cache = random_cache(runner.cache)
    step_batch = decode_batch(batch, args.context, args.block_size, num_blocks, cfg.vocab_size, rng)

    runner.held.apply(step_batch.inputs.delta)
    x = build_step_inputs(step_batch, runner.buckets, args.block_size, runner.held, runner.mark_decode)
    packed = jax.device_put(Packed.of(x))  # on the device already: the step's time alone

    allowed = runner._allowed(step_batch, x.temperature.shape[0])

    def device_step():
        result, runner.cache, runner._fed, runner._counts = runner._executable(x)(
            runner._weights, runner.cache, runner._fed, runner._counts, packed, allowed)
        return result.tokens

    step_s = median_seconds(device_step, repeats=args.repeats)
    backend = select_attention(args.attention)
    q = random_like((x.batch.meta.positions.shape[0], cfg.num_heads, cfg.head_dim), dtype, seed=99)
    attend = jax.jit(partial(backend.decode or backend.ragged, scale=cfg.head_dim**-0.5))
    k_pages, v_pages = runner.cache.k[0], runner.cache.v[0]  # layer 0's blocks: the tables' ids
    attention_s = cfg.num_layers * median_seconds(
        lambda: attend(q, k_pages, v_pages, x.batch.meta), repeats=args.repeats)
    execute_s = median_seconds(lambda: runner.execute(step_batch), repeats=args.repeats)
    copy_bps = copy_bandwidth(1 << 30 if gpu else 1 << 28)

    weight_bytes = sum(p.nbytes for p in jax.tree.leaves(runner.params))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    kv_read = batch * args.context * kv_per_token
    kv_written = batch * kv_per_token
    roofline_s = (weight_bytes + kv_read + kv_written) / copy_bps
    ratio = step_s / roofline_s
    result = {
        "device": device_name(), "date": today(), "model": args.model, "dtype": dtype.name,
        "attention": args.attention, "batch": batch, "context": args.context,
        "block_size": args.block_size, "weight_bytes": weight_bytes, "kv_read_bytes": kv_read,
        "copy_bytes_per_s": copy_bps, "roofline_s": roofline_s, "device_step_s": step_s,
        "execute_s": execute_s, "step_over_roofline": ratio, "batch_asked": args.batch,
        "attention_s": attention_s, "attention_roofline_s": (kv_read + kv_written) / copy_bps,
        "decode_params": decode_params, "jax_version": jax.__version__,
    }
    print(f"\n{args.model} ({dtype.name}, attention={args.attention}) on {device_name()}: "
          f"decode batch {batch}, context {args.context}")
    print(f"  weights {weight_bytes / 1e9:.2f} GB + K/V read {kv_read / 1e9:.2f} GB "
          f"at measured copy bandwidth {copy_bps / 1e9:.1f} GB/s")
    print(f"  {'roofline':<28} {roofline_s * 1e3:9.2f} ms")
    print(f"  {'device step':<28} {step_s * 1e3:9.2f} ms   {ratio:.2f}x roofline")
    print(f"  {'attention alone (x layers)':<28} {attention_s * 1e3:9.2f} ms   "
          f"{attention_s / ((kv_read + kv_written) / copy_bps):.2f}x its K/V roofline")
    print(f"  {'rest of the step':<28} {(step_s - attention_s) * 1e3:9.2f} ms   "
          f"{(step_s - attention_s) / (weight_bytes / copy_bps):.2f}x the weights' roofline")
    print(f"  {'runner.execute (with host)':<28} {execute_s * 1e3:9.2f} ms   "
          f"{execute_s / roofline_s:.2f}x roofline")
    if gpu:
        print(f"  goal: device step <= 1.25x roofline: {'PASS' if ratio <= 1.25 else 'MISS'}")
    else:
        print("  CPU: the jnp reference path; the 1.25x goal is for the Pallas kernels on H100")
    out = pathlib.Path(args.output or RESULTS / f"decode_step_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
