"""Where a step program's compile time and memory go (XLA:CPU): one bucket of the JAX
runner's step lowered and compiled as `JaxRunner._build` does, persistent cache off, as it
is and with parts of it swapped for trivial ones (an ablation: the variants drop behaviour a
request can ask for, so none is a candidate change), then the same for `sample_tokens`
alone. For the step as it is it also prints the cores a compile keeps busy, its serialized
size and the resident memory loading that serialized program adds.

    python bench/step_compile.py [--model tiny-llama] [--tokens 16] [--sampler-rows 16]
    python bench/step_compile.py --options --model smollm2-135m --tokens 16 64 512

`--options`: instead, the step as it is compiled under each set of XLA:CPU compiler options
in `OPTION_SETS`, three rounds turn about, with its compile time and the median of its runs
(an all-padding batch of the bucket: the model's full work at that shape).

The figures and what they say: bench/results/issue42_engine.md ("Where a step program's
compile goes", "What a compiled step's 55-90 MB is").
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import resource
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jserve.runners.jax_runner as jax_runner
import jserve.runners.sampling as sampling
from jserve import LLM
from jserve.runners.executables import return_freed_memory
from jserve.runners.packed_inputs import Packed
from jserve.runners.penalties import Penalties, TokenCounts
from jserve.runners.token_rules import SlotRules, TokenRules


def _resident_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _greedy(logits: jax.Array, *_: object, **__: object) -> tuple[jax.Array, jax.Array]:
    return jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros(logits.shape[0], jnp.float32)


def _no_top(logits: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return logits.astype(jnp.float32), jax_runner._no_top(logits.shape[0])


def _step_args(runner: Any, tokens: int) -> tuple[Any, ...]:
    """The arguments `JaxRunner._build` lowers a bucket's step for."""
    x = runner._padding_inputs(tokens, False, None)
    spec = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding))
    allowed = (jax.ShapeDtypeStruct((x.temperature.shape[0], runner._mask_words), np.int32,
                                    sharding=runner._fed.sharding), np.bool_(False), spec(runner._rules))
    return (runner._weights, runner._cache_spec, runner._fed_spec, spec(runner._counts), Packed.of(x), allowed)


def step_variants(model: str, tokens: int) -> None:
    originals = (jax_runner.sample_tokens, jax_runner._top, TokenCounts.counted)
    variants: list[tuple[str, Callable, Callable, Callable]] = [
        ("the step as it is", *originals),
        ("argmax instead of sample_tokens", _greedy, originals[1], originals[2]),
        ("no top log-probability branches", originals[0], _no_top, originals[2]),
        ("argmax, no top branches", _greedy, _no_top, originals[2]),
        ("and no token-count update", _greedy, _no_top, lambda self, rows, ids: self),
    ]
    print(f"{model}, T = {tokens}: compile seconds")
    for name, sample, top, counted in variants:
        jax_runner.sample_tokens, jax_runner._top, TokenCounts.counted = sample, top, counted
        jax_runner._shared_step.cache_clear()
        llm = LLM(model, num_blocks=64, warmup=False)
        lowered = llm.runner._step.lower(*_step_args(llm.runner, tokens))
        t0, c0 = time.perf_counter(), _cpu_s()
        compiled = lowered.compile()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        print(f"  {name:34s} {wall:6.2f}", flush=True)
        if name == "the step as it is":
            _program_memory(compiled, wall, cpu)
        del llm, lowered, compiled
    jax_runner.sample_tokens, jax_runner._top, TokenCounts.counted = originals
    jax_runner._shared_step.cache_clear()


# XLA:CPU debug options a step may be compiled with (`jax.stages.Lowered.compile`'s
# `compiler_options`). The runner compiles with XLA's defaults; the tests set both of the
# others and `--xla_backend_optimization_level=0` (tests/conftest.py).
OPTION_SETS: dict[str, dict[str, Any]] = {
    "XLA's defaults": {},
    "no fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "no expensive LLVM passes": {"xla_llvm_disable_expensive_passes": True},
    "both": {"xla_cpu_use_fusion_emitters": False, "xla_llvm_disable_expensive_passes": True},
}


def option_sets(model: str, buckets: list[int], rounds: int = 3, runs: int = 7) -> None:
    llm = LLM(model, num_blocks=64, warmup=False)
    r = llm.runner
    print(f"{model}: compile s / run ms (median of {runs}) per bucket, persistent cache off")
    for round_ in range(1, rounds + 1):
        for name, options in OPTION_SETS.items():
            cells = []
            for t in buckets:
                jax.clear_caches()  # else the round after the first finds its programs in memory
                x = r._padding_inputs(t, False, None)
                lowered = r._step.lower(*_step_args(r, t))
                t0 = time.perf_counter()
                exe = lowered.compile(compiler_options=options)
                compile_s = time.perf_counter() - t0
                s = x.temperature.shape[0]
                allowed = (r._unmasked(s), np.bool_(False), r._rules)
                times = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    out, r.cache, r._fed, r._counts = exe(r._weights, r.cache, r._fed, r._counts, Packed.of(x),
                                                          allowed)
                    jax.block_until_ready(out)
                    times.append(time.perf_counter() - t0)
                cells.append(f"T{t} {compile_s:5.2f} / {1e3 * float(np.median(times)):7.1f}")
            print(f"  round {round_} {name:34s} " + " | ".join(cells), flush=True)


def _program_memory(compiled: Any, wall: float, cpu: float) -> None:
    from jax.experimental import serialize_executable

    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    gc.collect()
    return_freed_memory()
    before = _resident_mb()
    loaded = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    gc.collect()
    return_freed_memory()
    print(f"    ({cpu / wall:.2f} cores busy; serialized {len(blob) / 2**20:.1f} MB; loading it added "
          f"{_resident_mb() - before:.0f} MB resident; temp {compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MB a run)")
    del loaded


def sampler_variants(rows: int, vocab: int, slots: int = 64) -> None:
    originals = {name: getattr(sampling, name) for name in ("_cutoffs", "_draw")}
    no_cutoffs = lambda x, *_, **__: jnp.full(x.shape[:1], -jnp.inf, x.dtype)  # noqa: E731
    argmax = lambda x, keys: jnp.argmax(x, -1).astype(jnp.int32)  # noqa: E731
    sd = jax.ShapeDtypeStruct

    def vec(dtype: Any) -> jax.ShapeDtypeStruct:
        return sd((rows,), dtype)

    args = (sd((rows, vocab), jnp.float32), vec(jnp.float32), vec(jnp.float32), vec(jnp.int32),
            vec(jnp.uint32), vec(jnp.int32), sd((rows, -(-vocab // 32)), jnp.int32), sd((), jnp.bool_),
            jax.tree.map(lambda a: sd(a.shape, a.dtype), TokenCounts.zeros(slots, vocab)),
            jax.tree.map(lambda a: sd(a.shape, a.dtype), SlotRules.zeros(slots, vocab)),
            vec(jnp.int32), vec(jnp.float32), vec(jnp.float32), vec(jnp.float32), vec(jnp.bool_), vec(jnp.bool_))
    variants = [("as it is", {}, True, True), ("no top-k / top-p cutoffs", {"_cutoffs": no_cutoffs}, True, True),
                ("no inverse-CDF draw", {"_draw": argmax}, True, True),
                ("neither (stochastic branch empty)", {"_cutoffs": no_cutoffs, "_draw": argmax}, True, True),
                ("no logit rules, no penalties", {}, False, True), ("no grammar mask", {}, True, False),
                ("none of these", {"_cutoffs": no_cutoffs, "_draw": argmax}, False, False)]
    print(f"sample_tokens alone, {rows} rows of {vocab} logits: compile seconds")
    for name, patch, ruled, masked in variants:
        for attr, part in {**originals, **patch}.items():
            setattr(sampling, attr, part)

        def sample(logits, t, p, k, seeds, index, bitmask, use_mask, counts, rules, slot, pres, freq, rep,
              biased, early, ruled=ruled, masked=masked):
            return sampling.sample_tokens(
                logits, t, p, k, seeds, index, rows_per_pass=2, token_mask=bitmask if masked else None,
                masked=use_mask, penalties=Penalties(counts, slot, pres, freq, rep) if ruled else None,
                rules=TokenRules(rules, slot, biased, early) if ruled else None)

        lowered = jax.jit(sample).lower(*args)
        t0 = time.perf_counter()
        lowered.compile()
        print(f"  {name:34s} {time.perf_counter() - t0:6.2f}", flush=True)
    for attr, part in originals.items():
        setattr(sampling, attr, part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16],
                    help="the bucket's token count (with --options, one or more)")
    ap.add_argument("--sampler-rows", type=int, default=16)
    ap.add_argument("--sampler-vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--options", action="store_true", help="compare OPTION_SETS instead")
    a = ap.parse_args()
    if len(a.tokens) > 1 and not a.options:
        ap.error("several --tokens need --options (the ablation compiles one bucket)")
    jax.config.update("jax_enable_compilation_cache", False)
    if a.options:
        option_sets(a.model, a.tokens)
    else:
        step_variants(a.model, a.tokens[0])
        sampler_variants(a.sampler_rows, a.sampler_vocab)


if __name__ == "__main__":
    main()
