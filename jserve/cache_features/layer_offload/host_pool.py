"""LayerKV's host tier: offloaded layers' K/V in host memory, one pool per layer, and the
jitted per-layer copies between it and the device pages."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.host_memory import memory_shardings
from jserve.models.paged import KVCache, block_copies


def _pad_ids(ids: np.ndarray, fill: int) -> np.ndarray:
    """Block ids padded to a power of two with `fill` (the scratch block), so the copy jits
    compile once per size class rather than once per length."""
    n = max(1, 1 << max(0, len(ids) - 1).bit_length())
    out = np.full(n, fill, np.int32)
    out[: len(ids)] = ids
    return out


def mapped_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array whose pages are mapped now. `np.zeros` leaves them for the OS to map on
    first write, and a LayerKV run writes most of its host pool once, so every offload paid
    for the mapping inside the step (`python bench/layer_copy_cost.py` measures the
    difference); mapping the pool when it is made moves that to start-up, as vLLM pins its
    whole swap space when it starts."""
    out = np.empty(shape, dtype)
    out.fill(0)
    return out


class LayerHostPool:
    """Offloaded layers' K/V (LayerKV) in host memory, one pool per layer and per K/V.

    Laid out per layer, `[num_host_blocks, block_size, kv_heads, head_dim]` each, rather than
    one buffer per request as swaps keep: a request's layers move one at a time and in
    different steps (its prefill writes some layers, an offload later adds others, a bring-
    back takes a few of them back), and the engine hands out host slots per layer
    (`jserve.cache.layers`), so the host copy of layer `l` of block `b` needs a fixed place
    of its own. The pools are pageable numpy arrays, mapped when made (`mapped_zeros`).
    Transfers go through `device_put` to pinned host memory where the backend has it (and
    to the device); a device -> host copy is issued without waiting for it and lands in the
    pool when the next step starts (`flush`), so on a GPU it overlaps the host's work and
    the next step's dispatch. On XLA:CPU "device" and "pinned host" are both host memory
    and every copy is a memcpy done at once.
    """

    def __init__(self, gather_blocks: Callable, scatter_blocks: Callable, shape: tuple[int, ...],
                 dtype: np.dtype, num_layers: int, scratch_block: int,
                 pages_sharding: jax.sharding.Sharding | None = None) -> None:
        """`pages_sharding`: how a layer's pages (and blocks gathered from them) are laid out."""
        self.k = [mapped_zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [mapped_zeros(shape, dtype) for _ in range(num_layers)]
        self.scratch_block = scratch_block
        self._gather, self._scatter = block_copies(gather_blocks, scatter_blocks)
        self._host, self._device = memory_shardings(pages_sharding)
        self._pending: list[tuple[int, np.ndarray, jax.Array, jax.Array]] = []

    def warm_up(self, cache: KVCache) -> KVCache:
        """Compile the copies for every padded size a step can ask for (one block up to a
        layer's whole device pool), both ways, so a run's first offloads do not pay for
        compiling them; only the scratch block is written."""
        page = self.k[0].shape[1:]
        n = 1
        while True:
            ids = np.full(n, self.scratch_block, np.int32)
            cache = self.scatter(cache, 0, ids, *self.gather(cache, 0, ids))
            from_host = np.zeros((n, *page), self.k[0].dtype)
            cache = self.scatter(cache, 0, ids, from_host, from_host)
            if n >= cache.blocks_per_layer:
                return cache
            n *= 2

    def read(self, layer: int, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s K and V blocks at `host_ids` (copies)."""
        self.flush()
        return self.k[layer][host_ids], self.v[layer][host_ids]

    def gather(self, cache: KVCache, layer: int, ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s device blocks `ids`, padded (the caller keeps `len(ids)`)."""
        padded = jnp.asarray(cache.flat_ids(_pad_ids(ids, self.scratch_block), layer))
        return self._gather(cache, padded)

    def write_from_device(self, layer: int, host_ids: np.ndarray, k: jax.Array, v: jax.Array) -> None:
        """Copy gathered device blocks (the first `len(host_ids)`) to the host pool: issued
        now, landing at the next `flush`."""
        if self._host is not None:
            k, v = jax.device_put(k, self._host), jax.device_put(v, self._host)
        self._pending.append((layer, host_ids, k, v))

    def flush(self) -> None:
        for layer, host_ids, k, v in self._pending:
            n = len(host_ids)
            self.k[layer][host_ids] = np.asarray(k)[:n]
            self.v[layer][host_ids] = np.asarray(v)[:n]
        self._pending.clear()

    def scatter(self, cache: KVCache, layer: int, ids: np.ndarray, k: np.ndarray | jax.Array,
                v: np.ndarray | jax.Array) -> KVCache:
        """`cache` with layer `layer`'s blocks `ids` set to `k`, `v` (blocks read from the
        host pool, or gathered on the device by `gather`); only those blocks are written
        (the layer's pools are donated)."""
        padded = _pad_ids(ids, self.scratch_block)
        k, v = self._on_device(k, len(padded)), self._on_device(v, len(padded))
        return self._scatter(cache, jnp.asarray(cache.flat_ids(padded, layer)), k, v)

    def _on_device(self, x: np.ndarray | jax.Array, n: int) -> jax.Array:
        """Host blocks padded to `n` and moved to the device; device ones are `gather`'s,
        already `n` long."""
        if not isinstance(x, np.ndarray):
            return x
        if len(x) < n:
            x = np.concatenate([x, np.zeros((n - len(x), *x.shape[1:]), x.dtype)])
        return jax.device_put(x, self._device) if self._device is not None else jnp.asarray(x)
