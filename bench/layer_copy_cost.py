#!/usr/bin/env python
"""Where LayerKV's layer copies spend their time, stage by stage, beside a plain `device_put`
of the same bytes: why `bench/layerkv_cpu.py` saw its layer copies move at a fifth of
`device_put`'s rate before the pool compiled its copies in warm-up and mapped its pages
when made.

One request's worth of offload (SmolLM2's shapes by default: `--blocks` blocks of every one of
its 30 layers, K and V) goes through the runner's own path (`LayerHostPool`): per layer a
jitted gather of the blocks, a `device_put` to the host memory kind, and at `flush` a write
into the per-layer numpy pool; then back (pool read + donated scatter). Each stage is timed
alone (median, outputs ready), and the offload twice: into host slots written before and into
a fresh pool. Beside them, what the pool's `mapped_zeros` moves to start-up: making a pool
(its pages mapped then), and the same bytes written once into a fresh `np.zeros` array,
whose pages the OS maps on first write, as an unmapped pool's were in a run's first pass
over the host tier.

    python bench/layer_copy_cost.py [--model smollm2-135m] [--blocks 64] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import device_name, median_seconds, random_like, results_tag, today

from jserve.cache.host_memory import memory_shardings
from jserve.cache_features.layer_offload.host_pool import LayerHostPool
from jserve.models.paged import KVCache
from jserve.models.registry import get_config
from jserve.pallas_kernels.block_copy import gather_blocks_reference, scatter_blocks_reference

RESULTS = pathlib.Path(__file__).parent / "results"


def measure(model: str, blocks: int, block_size: int, repeats: int) -> dict[str, float]:
    cfg = get_config(model)
    layers, page = cfg.num_layers, (block_size, cfg.num_kv_heads, cfg.head_dim)
    pool_shape = (layers, blocks + 1, *page)
    # a scatter donates the pools it writes: every stage reads the latest cache here
    held = {"cache": KVCache(k=random_like(pool_shape, jnp.float32, seed=0),
                             v=random_like(pool_shape, jnp.float32, seed=1))}
    ids = np.arange(blocks, dtype=np.int32)
    host_slots = np.arange(blocks, dtype=np.int32)
    host, _ = memory_shardings()

    def new_pool() -> LayerHostPool:
        return LayerHostPool(gather_blocks_reference, scatter_blocks_reference, (blocks, *page),
                             np.dtype(np.float32), layers, scratch_block=blocks)

    warm = new_pool()
    fresh = [new_pool() for _ in range(repeats + 2)]  # built outside the timed part
    one_buffer = random_like((2 * layers * blocks, *page), jnp.float32)
    source = np.asarray(one_buffer)
    unmapped = [np.zeros(source.shape, source.dtype) for _ in range(repeats + 2)]

    def first_write() -> None:
        unmapped.pop()[...] = source

    def gather() -> object:
        return [warm.gather(held["cache"], layer, ids) for layer in range(layers)]

    def gather_put() -> object:
        return [(jax.device_put(k, host), jax.device_put(v, host)) if host else (k, v)
                for k, v in gather()]

    def offload(pool: LayerHostPool) -> None:
        for layer in range(layers):
            pool.write_from_device(layer, host_slots, *pool.gather(held["cache"], layer, ids))
        pool.flush()

    def bring_back() -> object:
        for layer in range(layers):
            held["cache"] = warm.scatter(held["cache"], layer, ids, *warm.read(layer, host_slots))
        return held["cache"].k

    offload(warm)  # maps the warm pool's pages before any timing
    stages = {
        "plain device_put of one buffer": lambda: jax.device_put(one_buffer, host) if host
        else np.asarray(one_buffer),
        "gather (jit, per layer)": gather,
        "gather + device_put to host kind": gather_put,
        "offload into written host slots": lambda: offload(warm),
        "offload into a fresh pool": lambda: offload(fresh.pop()),
        "making a pool (start-up, maps its pages)": new_pool,
        "first write into unmapped np.zeros": first_write,
        "bring back (pool read + donated scatter)": bring_back,
    }
    return {name: median_seconds(fn, warmup=1, repeats=repeats) for name, fn in stages.items()}, \
        2 * layers * blocks * int(np.prod(page)) * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per layer moved (default: 64, "
                    "a 1,024-token prompt at block size 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    times, nbytes = measure(args.model, args.blocks, args.block_size, args.repeats)
    plain = times["plain device_put of one buffer"]
    print(f"{device_name()}, {args.model}: {args.blocks} blocks x {get_config(args.model).num_layers} "
          f"layers x K and V = {nbytes / 1e6:.1f} MB, host memory kind {memory_shardings()[0] and 'pinned_host'}")
    print(f"{'stage':44s} {'ms':>8s} {'GB/s':>7s} {'time / plain':>13s}")
    for name, s in times.items():
        print(f"{name:44s} {s * 1e3:8.1f} {nbytes / s / 1e9:7.2f} {s / plain:12.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"layer_copy_cost_{results_tag()}.json"
    out.write_text(json.dumps(dict(device=device_name(), date=today(), model=args.model,
                                   blocks=args.blocks, block_size=args.block_size, bytes=nbytes,
                                   seconds=times), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
