"""A model's layers unrolled (jserve's models until the layer loop: per-layer parameters and
KV pages, one copy of the layer in the program per layer) against one `lax.scan` over
stacked layers whose KV pages are one array carried through the loop, written and read at
`[layer, slot]` in place (what `jserve.models.paged.run_blocks` does). Both compute the
same thing. The script prints each one's compile time and decode step, side by side: the
evidence that led to the layer loop (docs/architecture.md). Resident memory is not read
here: a deleted program's memory does not come back while JAX holds references to it.

SmolLM2-135M's shapes (30 layers, hidden 576, 9 query and 3 KV heads, MLP 1536, vocabulary
49,152), one decode token per sequence, a plain jnp paged attention over 256 tokens of
context. The weights are random: only time and memory are read.

    python bench/layer_loop.py [--layers 30] [--batch 32] [--steps 30] [--rounds 2]

Each variant runs in a process of its own, turn about, `--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 576, 9, 3, 64, 1536, 49152
NUM_BLOCKS, BLOCK, TABLE = 512, 16, 16  # pages, tokens a page, pages a sequence reads
CONTEXT = 200


def measure(variant: str, layers: int, batch: int, steps: int) -> dict[str, float]:
    """One variant's compile seconds and median step ms."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)
    rng = np.random.default_rng(0)

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    def rms(x: jax.Array, g: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * g

    def layer(x, p, k_pages, v_pages, slots, rows, context, at=()):
        """One layer; `at`: the layer's index into stacked pages (none: its own pages)."""
        h = rms(x, p["n1"])
        q = (h @ p["wq"]).reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        k = (h @ p["wk"]).reshape(batch, KV_HEADS, HEAD_DIM)
        v = (h @ p["wv"]).reshape(batch, KV_HEADS, HEAD_DIM)
        k_pages, v_pages = k_pages.at[(*at, slots)].set(k), v_pages.at[(*at, slots)].set(v)
        ks, vs = k_pages[(*at, rows)], v_pages[(*at, rows)]  # [batch, context, kv heads, dim]
        scores = jnp.einsum("sghd,schd->sghc", q, ks) / np.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.arange(TABLE * BLOCK) < context[:, None, None, None], scores, -jnp.inf)
        o = jnp.einsum("sghc,schd->sghd", jax.nn.softmax(scores, -1), vs).reshape(batch, -1)
        x = x + o @ p["wo"]
        h = rms(x, p["n2"])
        return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"], k_pages, v_pages

    params = [dict(n1=w(HIDDEN), n2=w(HIDDEN), wq=w(HIDDEN, HEADS * HEAD_DIM),
                   wk=w(HIDDEN, KV_HEADS * HEAD_DIM), wv=w(HIDDEN, KV_HEADS * HEAD_DIM),
                   wo=w(HEADS * HEAD_DIM, HIDDEN), wg=w(HIDDEN, MLP), wu=w(HIDDEN, MLP),
                   wd=w(MLP, HIDDEN)) for _ in range(layers)]
    embed = w(VOCAB, HIDDEN)
    pages = (NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM)

    if variant == "unrolled":
        cache = [(jnp.zeros(pages), jnp.zeros(pages)) for _ in range(layers)]

        def step(params, cache, embed, ids, slots, rows, context):
            x, out = embed[ids], []
            for p, (k_pages, v_pages) in zip(params, cache):
                x, k_pages, v_pages = layer(x, p, k_pages, v_pages, slots, rows, context)
                out.append((k_pages, v_pages))
            return jnp.argmax(rms(x, 1.0) @ embed.T, -1), out
    else:
        cache = (jnp.zeros((layers, *pages)), jnp.zeros((layers, *pages)))
        params = jax.tree.map(lambda *a: jnp.stack(a), *params)

        def step(params, cache, embed, ids, slots, rows, context):
            def body(carry, xs):
                p, i = xs
                return layer(*carry[:1], p, *carry[1:], slots, rows, context, at=(i,)), None

            (x, k_pages, v_pages), _ = jax.lax.scan(body, (embed[ids], *cache), (params, jnp.arange(layers)))
            return jnp.argmax(rms(x, 1.0) @ embed.T, -1), (k_pages, v_pages)

    tables = rng.permutation(NUM_BLOCKS)[: batch * TABLE].reshape(batch, TABLE)
    rows = jnp.asarray((tables[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(batch, -1), jnp.int32)
    slots = jnp.asarray(tables[:, CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK, jnp.int32)
    ids = jnp.asarray(rng.integers(0, VOCAB, batch), jnp.int32)
    context = jnp.full((batch,), CONTEXT + 1, jnp.int32)
    args = (embed, ids, slots, rows, context)

    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(1,)).lower(params, cache, *args).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens, cache = compiled(params, cache, *args)
        tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "step_ms": 1e3 * float(np.median(times[steps // 5:]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=("unrolled", "scan"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.layers, a.batch, a.steps)))
        return
    from jserve.benchmarking.tables import markdown_table

    rows = []
    for r in range(a.rounds):
        got = {}
        for variant in ("unrolled", "scan"):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--layers", str(a.layers),
                                  "--batch", str(a.batch), "--steps", str(a.steps)],
                                 check=True, capture_output=True, text=True).stdout
            got[variant] = json.loads(out.strip().splitlines()[-1])
        u, s = got["unrolled"], got["scan"]
        rows.append([r + 1, *(f"{u[k]:.2f} / {s[k]:.2f} ({s[k] / u[k]:.2f}x)" for k in ("compile_s", "step_ms"))])
    print(f"{a.layers} layers, batch {a.batch}: unrolled / scan (scan's ratio)")
    print("\n".join(markdown_table(["round", "compile s", "decode step ms"], rows)))


if __name__ == "__main__":
    main()
