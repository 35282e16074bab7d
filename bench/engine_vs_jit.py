"""The engine's decode step against the same model's own jitted decode loop, side by side.

On a GPU a small model's decode step takes a few milliseconds, so the host work the engine
adds per step (planning, the batch, metadata, reading tokens back) is what a user sees. The
floor is the model's own step with no host work: greedy decodes over `functional.decode_batch`
and the model, either `lax.fori_loop` inside one jit ("jit loop") or one jitted step per call
with the tokens staying on the device ("jit step"; on XLA:CPU a loop carrying a large cache
can cost more than the calls), whichever is faster. The engine's figure is the wall time per
`Engine.step()` with every request decoding (prompts done, nothing finishing, the `vllm`
policy), over the same model and batch.

The two are measured turn about, in rounds: a block of `--steps` engine steps, then the
floor's loop and its steps over the same positions the engine's block decoded (attention
walks the context, so a floor that restarts at the prompt is cheaper than an engine whose
sequences grew). Each round's ratio compares figures taken seconds apart, so this machine's
drift between runs cancels; the median round is printed, with the range. That ratio is the
figure of merit (issue 42's goals: within 1.25x on tiny-llama at batch 32, 1.05x on
SmolLM2). The engine pads a step's tokens to its bucket (at least 16: `MIN_TOKENS`), so
where the bucket is larger than the batch, the floor is also taken at the bucket's batch
("jit @bucket", the faster of loop and step) and the engine's step set against it.

    python bench/engine_vs_jit.py [--models tiny-llama,smollm2-135m] [--batches 1,32,128]
                                  [--steps 16] [--rounds 9] [--xla-cpu-cores N] [--output FILE]

On a CPU the step the engine dispatches and the host work meant to hide behind it share the
cores. `--xla-cpu-cores N` starts XLA's CPU thread pools on the first N cores and leaves the
Python thread on all (`jserve.runners.cpu_threads`, the server's `--xla-cpu-cores`): the
trial behind bench/results/issue42_engine.md's "Where the engine's step waits on two cores".
A second table gives each side's CPU time per step (every thread of the process) and the
least ratio it allows: the engine's CPU time spread over the cores, against the floor. Where
the measured ratio is near that bound, the cores were busy all step, and only less work, not
more overlap, can shorten it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np

from decoding_engine import BLOCK, PROMPT, decoding_engine
from jserve.models import functional
from jserve.runners.cpu_threads import start_xla_on


@dataclass(frozen=True)
class Row:
    """One model and batch: per round, ms per step of each side, in wall time and in the
    process's CPU time (all its threads: XLA's pools and the Python thread)."""

    model: str
    batch: int
    bucket: int
    cores: int
    engine_ms: list[float]
    jit_loop_ms: list[float]
    jit_step_ms: list[float]
    jit_bucket_ms: list[float]
    engine_cpu_ms: list[float]
    jit_cpu_ms: list[float]  # of the faster of loop and step

    @property
    def floor_ms(self) -> list[float]:
        """Per round, the faster of the jitted loop and the jitted steps."""
        return [min(lo, st) for lo, st in zip(self.jit_loop_ms, self.jit_step_ms)]

    @property
    def ratios(self) -> list[float]:
        return [e / f for e, f in zip(self.engine_ms, self.floor_ms)]

    @property
    def cpu_bound_ratios(self) -> list[float]:
        """The ratio the engine's CPU time allows at best: its CPU seconds spread evenly over
        the process's cores, against the floor. Where the engine's ratio is near it, the
        cores are busy all step and only less work (host or device) shortens the step."""
        return [c / self.cores / f for c, f in zip(self.engine_cpu_ms, self.floor_ms)]

    @property
    def bucket_ratios(self) -> list[float]:
        return [e / b for e, b in zip(self.engine_ms, self.jit_bucket_ms)]


def median_and_range(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


ratio_cell = functools.partial(median_and_range, fmt="{:.2f}x")


class Floor:
    """The model's own greedy decode of `batch` sequences from a given position, no host
    work: `block(start)` is ms per step over `steps` steps of the jitted loop and of the
    jitted step called once per step."""

    def __init__(self, paged: functional.PagedModel, params: object, batch: int, steps: int, max_len: int):
        per_seq = -(-max_len // BLOCK)
        cfg = paged.bind(params).cfg
        tables = jnp.arange(batch * per_seq, dtype=jnp.int32).reshape(batch, per_seq)
        decode_only = paged.attention.specialises_decode

        def one(params, cache, tokens, position):
            b = functional.decode_batch(tokens, jnp.full((batch,), position, jnp.int32), tables,
                                        block_size=BLOCK, decode_only=decode_only)
            logits, cache = paged(params, cache, b)
            return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        @functools.partial(jax.jit, donate_argnums=1)
        def loop(params, cache, tokens, start):
            return jax.lax.fori_loop(0, steps, lambda i, c: one(params, *c, start + i), (cache, tokens))

        self._loop, self._step = loop, jax.jit(one, donate_argnums=1)
        self._params, self._steps = params, steps
        self._tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, batch), jnp.int32)
        dtype = jax.tree.leaves(params)[0].dtype
        self._cache = functional.KVCache.zeros(cfg, num_blocks=batch * per_seq, block_size=BLOCK, dtype=dtype)
        self.block(PROMPT)  # compile both

    def block(self, start: int) -> tuple[float, float, float]:
        """ms per step of the loop and of the steps, and the CPU ms per step of the faster."""
        c0, t0 = time.process_time(), time.perf_counter()
        self._cache, out = self._loop(self._params, self._cache, self._tokens, np.int32(start))
        out.block_until_ready()
        c1, t1 = time.process_time(), time.perf_counter()
        out = self._tokens
        for i in range(self._steps):  # each step fed the last one's tokens, as a greedy decode
            self._cache, out = self._step(self._params, self._cache, out, np.int32(start + i))
        out.block_until_ready()
        c2, t2 = time.process_time(), time.perf_counter()
        loop, step = (t1 - t0), (t2 - t1)
        cpu = (c1 - c0) if loop <= step else (c2 - c1)
        return 1e3 * loop / self._steps, 1e3 * step / self._steps, 1e3 * cpu / self._steps


def measure(model: str, batch: int, steps: int, rounds: int) -> Row:
    max_len = PROMPT + (rounds + 2) * steps + 8
    built = decoding_engine(model, batch, max_len)
    engine = built.engine
    paged, params = functional.split(built.loaded.model)
    bucket = engine.runner.buckets.tokens(batch)
    floor = Floor(paged, params, batch, steps, max_len)
    at_bucket = Floor(paged, params, bucket, steps, max_len) if bucket != batch else None
    for _ in range(4):  # past the first pipelined steps
        engine.step()
    engine_ms, loop_ms, step_ms, bucket_ms, engine_cpu, floor_cpu = [], [], [], [], [], []
    for _ in range(rounds):
        start = PROMPT + len(next(iter(engine.state.live.requests.values())).output_token_ids)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine_ms.append(1e3 * (time.perf_counter() - t0) / steps)
        engine_cpu.append(1e3 * (time.process_time() - c0) / steps)
        lo, st, cpu = floor.block(start)
        loop_ms.append(lo)
        step_ms.append(st)
        floor_cpu.append(cpu)
        bucket_ms.append(min(at_bucket.block(start)[:2]) if at_bucket else min(lo, st))
    return Row(model, batch, bucket, len(os.sched_getaffinity(0)), engine_ms, loop_ms, step_ms,
               bucket_ms, engine_cpu, floor_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-llama,smollm2-135m")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block")
    ap.add_argument("--rounds", type=int, default=9, help="engine and floor blocks, turn about")
    ap.add_argument("--xla-cpu-cores", type=int,
                    help="start XLA's CPU thread pools on this many cores (default: all)")
    ap.add_argument("--output", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.xla_cpu_cores is not None:
        try:
            start_xla_on(args.xla_cpu_cores)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    rows = []
    print(f"ms per step, median of the rounds (range); ratio: engine / floor, round by round; "
          f"contexts {PROMPT + 5}-{PROMPT + 5 + args.rounds * args.steps} tokens")
    print(f"{'model':14} {'batch':>5} {'engine':>21} {'jit loop':>21} {'jit step':>21} "
          f"{'ratio':>18} {'bucket':>6} {'jit @bucket':>21} {'ratio':>18}")
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            row = measure(model, batch, args.steps, args.rounds)
            rows.append(row)
            print(f"{model:14} {batch:5d} {median_and_range(row.engine_ms):>21} "
                  f"{median_and_range(row.jit_loop_ms):>21} {median_and_range(row.jit_step_ms):>21} "
                  f"{ratio_cell(row.ratios):>18} {row.bucket:6d} {median_and_range(row.jit_bucket_ms):>21} "
                  f"{ratio_cell(row.bucket_ratios):>18}", flush=True)
    print("\nCPU ms per step (the process's threads together); bound: the engine's CPU time over "
          "its cores against the floor's wall time, the least ratio that CPU time allows")
    print(f"{'model':14} {'batch':>5} {'cores':>5} {'engine cpu':>21} {'jit cpu':>21} {'bound':>18} {'ratio':>18}")
    for row in rows:
        print(f"{row.model:14} {row.batch:5d} {row.cores:5d} {median_and_range(row.engine_cpu_ms):>21} "
              f"{median_and_range(row.jit_cpu_ms):>21} {ratio_cell(row.cpu_bound_ratios):>18} {ratio_cell(row.ratios):>18}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                       "backend": jax.default_backend(), "steps": args.steps, "rounds": args.rounds,
                       "xla_cpu_cores": args.xla_cpu_cores,
                       "rows": [asdict(r) | {"ratios": r.ratios, "bucket_ratios": r.bucket_ratios,
                                             "cpu_bound_ratios": r.cpu_bound_ratios}
                                for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
