"""Swapped-out requests' K/V, kept in host memory until they are swapped back in.

A swap-out gathers the request's blocks of every layer's K and V (`models.paged.block_copies`
over the pool seen flat, the copies LayerKV's offloads make one layer at a time) and moves
them to host memory in one `device_put`; a swap-in moves them back and scatters them into the
request's new blocks inside a jit that donates the pool, so only those blocks are written.
One buffer pair per request rather than a host pool mirroring the device's: a swap is then a
single transfer each way and the host copy needs no block bookkeeping of its own (the engine
state accounts for host blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.host_memory import memory_shardings
from jserve.engine.batch import BlockMove
from jserve.models.paged import KVCache, block_copies

Blocks = tuple[jax.Array, jax.Array] | tuple[np.ndarray, np.ndarray]  # K, V: [layers * n, ...]


class HostKVStore:
    def __init__(self, gather_blocks: Callable, scatter_blocks: Callable,
                 pages_sharding: jax.sharding.Sharding | None = None) -> None:
        """`pages_sharding`: how gathered blocks (`[n, block_size, kv_heads, head_dim]`) are
        laid out on the devices."""
        self._gather, self._scatter = block_copies(gather_blocks, scatter_blocks)
        self._host, self._device = memory_shardings(pages_sharding)
        self._held: dict[int, Blocks] = {}

    def __len__(self) -> int:
        return len(self._held)

    def swap_out(self, cache: KVCache, move: BlockMove) -> None:
        if move.seq_id in self._held:
            raise RuntimeError(f"seq {move.seq_id} is already swapped out")
        blocks = self._gather(cache, _every_layer(cache, move.device_blocks))
        self._held[move.seq_id] = (tuple(np.asarray(b) for b in blocks) if self._host is None
                                   else jax.device_put(blocks, self._host))

    def swap_in(self, cache: KVCache, move: BlockMove) -> KVCache:
        held = self._held.pop(move.seq_id)
        layers = cache.k.shape[0]
        if len(held[0]) != layers * len(move.device_blocks):
            raise RuntimeError(f"seq {move.seq_id}: {len(held[0]) // layers} blocks swapped out, "
                               f"{len(move.device_blocks)} to swap in")
        blocks = (jax.device_put(held, self._device) if self._device is not None
                  else tuple(map(jnp.asarray, held)))
        return self._scatter(cache, _every_layer(cache, move.device_blocks), *blocks)

    def copy(self, cache: KVCache, src: np.ndarray, dst: np.ndarray) -> KVCache:
        """Device blocks `src` copied onto `dst`, every layer (a forked sequence's copy of
        the block it writes next), with the swaps' gather and scatter."""
        return self._scatter(cache, _every_layer(cache, dst), *self._gather(cache, _every_layer(cache, src)))

    def drop(self, seq_id: int) -> None:
        """Forget a request that ended while swapped out."""
        self._held.pop(seq_id, None)


def _every_layer(cache: KVCache, blocks: Sequence[int] | np.ndarray) -> jax.Array:
    """Device blocks `blocks` of every layer, as ids of the pool seen flat (`KVCache.flat_ids`)."""
    return jnp.asarray(cache.flat_ids(np.asarray(blocks, np.int32)))
