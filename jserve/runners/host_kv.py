"""Swapped-out requests' K/V, kept in host memory until they are swapped back in.

A swap-out gathers the request's blocks of every layer's K and V into one device buffer
(`[2 * layers, n, block_size, kv_heads, head_dim]`) and moves it to host memory in one
`device_put`; a swap-in moves it back and scatters it into the request's new blocks inside a
jit that donates the pool, so only those blocks are written. One buffer per request rather
than a host pool mirroring the device's: a swap is then a single transfer each way and the
host copy needs no block bookkeeping of its own (the engine state accounts for host blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.host_memory import memory_shardings
from jserve.engine.batch import BlockMove
from jserve.models.paged import KVCache


class HostKVStore:
    def __init__(self, gather_blocks: Callable, scatter_blocks: Callable,
                 buffer_sharding: jax.sharding.Sharding | None = None) -> None:
        """`buffer_sharding`: how a gathered swap buffer is laid out on the devices."""
        def gather(cache: KVCache, ids: jax.Array) -> jax.Array:
            every = cache.flat_ids(ids)
            blocks = jnp.stack([gather_blocks(pool, every) for pool in cache.flat()])
            return blocks.reshape(2 * cache.k.shape[0], len(ids), *cache.k.shape[2:])

        def scatter(cache: KVCache, ids: jax.Array, blocks: jax.Array) -> KVCache:
            every, layers = cache.flat_ids(ids), cache.k.shape[0]
            k, v = (scatter_blocks(pool, every, part.reshape(-1, *part.shape[2:]))
                    for pool, part in zip(cache.flat(), (blocks[:layers], blocks[layers:])))
            return cache.of_flat(k, v)

        self._gather = jax.jit(gather)
        self._scatter = jax.jit(scatter, donate_argnums=0)
        self._host, self._device = memory_shardings(buffer_sharding)
        self._held: dict[int, jax.Array | np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._held)

    def swap_out(self, cache: KVCache, move: BlockMove) -> None:
        if move.seq_id in self._held:
            raise RuntimeError(f"seq {move.seq_id} is already swapped out")
        buf = self._gather(cache, jnp.asarray(move.device_blocks))
        self._held[move.seq_id] = np.asarray(buf) if self._host is None else jax.device_put(buf, self._host)

    def swap_in(self, cache: KVCache, move: BlockMove) -> KVCache:
        held = self._held.pop(move.seq_id)
        if held.shape[1] != len(move.device_blocks):
            raise RuntimeError(f"seq {move.seq_id}: {held.shape[1]} blocks swapped out, "
                               f"{len(move.device_blocks)} to swap in")
        buf = jax.device_put(held, self._device) if self._device is not None else jnp.asarray(held)
        return self._scatter(cache, jnp.asarray(move.device_blocks), buf)

    def copy(self, cache: KVCache, src: np.ndarray, dst: np.ndarray) -> KVCache:
        """Device blocks `src` copied onto `dst`, every layer (a forked sequence's copy of
        the block it writes next), with the swaps' gather and scatter."""
        return self._scatter(cache, jnp.asarray(dst), self._gather(cache, jnp.asarray(src)))

    def drop(self, seq_id: int) -> None:
        """Forget a request that ended while swapped out."""
        self._held.pop(seq_id, None)
