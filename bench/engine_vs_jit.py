"""The engine's decode step against the same model's own jitted decode loop, side by side.

On a GPU a small model's decode step takes a few milliseconds, so the host work the engine
adds per step (planning, the batch, metadata, reading tokens back) is what a user sees. The
floor is the model's own step with no host work: greedy decodes over `functional.decode_batch`
and the model, either `lax.fori_loop` inside one jit ("jit loop") or one jitted step per call
with the tokens staying on the device ("jit step"; on XLA:CPU a loop carrying a large cache
can cost more than the calls), whichever is faster. The engine's figure is the
median wall time of `Engine.step()` with every request decoding (prompts done, nothing
finishing, the `vllm` policy), over the same model, batch and context. The ratio is the
figure of merit (issue 42's goals: within 1.25x on tiny-llama at batch 32, 1.05x on
SmolLM2). The engine pads a step's tokens to its bucket (at least 16: `MIN_TOKENS`), so
where the bucket is larger than the batch, the floor is also taken at the bucket's batch
("jit @bucket", the faster of loop and step) and the engine's step set against it.

    python bench/engine_vs_jit.py [--models tiny-llama,smollm2-135m] [--batches 1,32,128]
                                  [--steps 64] [--repeats 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np

from jserve.builder import build_engine
from jserve.config import EngineConfig
from jserve.engine.sampling_params import SamplingParams
from jserve.models import functional

PROMPT = 32  # tokens of each prompt: the context every step starts from
BLOCK = 16


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    engine_ms: float
    jit_loop_ms: float
    jit_step_ms: float
    bucket: int
    jit_bucket_ms: float

    @property
    def jit_ms(self) -> float:
        return min(self.jit_loop_ms, self.jit_step_ms)

    @property
    def ratio(self) -> float:
        return self.engine_ms / self.jit_ms

    @property
    def bucket_ratio(self) -> float:
        return self.engine_ms / self.jit_bucket_ms


def engine_step_ms(model: str, batch: int, steps: int,
                   repeats: int) -> tuple[float, int, tuple[functional.PagedModel, object]]:
    """Median `Engine.step()` of `batch` decoding requests (best of `repeats` runs of
    `steps`), the token bucket its steps run in, and the engine's model as (PagedModel,
    params) for the jitted loop."""
    max_len = PROMPT + (repeats + 1) * steps + 8
    built = build_engine(EngineConfig(model=model, max_num_seqs=batch, max_model_len=max_len,
                                      num_blocks=batch * -(-max_len // BLOCK) + 8, block_size=BLOCK))
    engine = built.engine
    rng = np.random.default_rng(0)
    vocab = built.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_len - PROMPT, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(1, vocab, PROMPT).tolist(), params)
    while any(not r.output_token_ids for r in engine.state.live.requests.values()):
        engine.step()
    best = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        best.append(statistics.median(times))
    return 1e3 * min(best), engine.runner.buckets.tokens(batch), functional.split(built.loaded.model)


def jit_step_ms(paged: functional.PagedModel, params: object, batch: int, steps: int,
                repeats: int, vocab: int) -> tuple[float, float]:
    """One decode step of the model's own greedy decode, no host work: (a `fori_loop` of
    `steps` steps in one jit, one jitted step per call with the tokens on the device)."""
    per_seq = -(-(PROMPT + (repeats + 2) * steps + 1) // BLOCK)
    dtype = jax.tree.leaves(params)[0].dtype
    cfg = paged.bind(params).cfg
    tables = jnp.arange(batch * per_seq, dtype=jnp.int32).reshape(batch, per_seq)
    decode_only = paged.attention.specialises_decode

    def one(params, cache, tokens, i):
        positions = jnp.full((batch,), PROMPT, jnp.int32) + i
        b = functional.decode_batch(tokens, positions, tables, block_size=BLOCK, decode_only=decode_only)
        logits, cache = paged(params, cache, b)
        return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=1)
    def loop(params, cache, tokens):
        return jax.lax.fori_loop(0, steps, lambda i, c: one(params, *c, i), (cache, tokens))

    step = jax.jit(one, donate_argnums=1)
    tokens0 = jnp.asarray(np.random.default_rng(0).integers(1, vocab, batch), jnp.int32)

    def timed(run) -> float:
        cache = functional.KVCache.zeros(cfg, num_blocks=batch * per_seq, block_size=BLOCK, dtype=dtype)
        cache, out = run(cache)  # compile
        out.block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            cache, out = run(cache)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - t0) / steps)
        return 1e3 * best

    def stepped(cache):
        tokens = tokens0
        for i in range(steps):
            cache, tokens = step(params, cache, tokens, jnp.int32(i))
        return cache, tokens

    return timed(lambda cache: loop(params, cache, tokens0)), timed(stepped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-llama,smollm2-135m")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    print(f"{'model':14} {'batch':>5} {'engine ms':>10} {'jit loop':>9} {'jit step':>9} {'ratio':>6} "
          f"{'bucket':>6} {'jit @bucket':>11} {'ratio':>6}")
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            engine_ms, bucket, (paged, params) = engine_step_ms(model, batch, args.steps, args.repeats)
            vocab = paged.bind(params).cfg.vocab_size
            loop_ms, step_ms = jit_step_ms(paged, params, batch, args.steps, args.repeats, vocab)
            at_bucket = (min(jit_step_ms(paged, params, bucket, args.steps, args.repeats, vocab))
                         if bucket != batch else min(loop_ms, step_ms))
            row = Row(model, batch, engine_ms, loop_ms, step_ms, bucket, at_bucket)
            rows.append(row)
            print(f"{model:14} {batch:5d} {engine_ms:10.3f} {loop_ms:9.3f} {step_ms:9.3f} "
                  f"{row.ratio:6.2f}x {bucket:6d} {at_bucket:11.3f} {row.bucket_ratio:6.2f}x", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                       "backend": jax.default_backend(), "steps": args.steps, "repeats": args.repeats,
                       "rows": [asdict(r) | {"jit_ms": r.jit_ms, "ratio": r.ratio, "bucket_ratio": r.bucket_ratio}
                                for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
