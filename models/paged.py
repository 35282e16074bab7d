"""The paged-attention interface between models and runners."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.hidden_attention import KVProjection


class AttentionFn(Protocol):
    """Write the step's new `k`, `v` `[T, kv_heads, d]` into the pages and attend with `q`.

    One call does both so that a backend may fuse the write into its kernel. Returns the
    attention output `[T, heads, d]` and the updated pages. `hidden` (the attention input
    rows `[T, hidden_size]`) and `proj` (the layer's K/V projection) are read only by the
    hidden cache's wrapper of a backend, for the sequences the metadata's part
    (`meta.parts`) puts on Apt-Serve's hidden cache; a backend of paged KV ignores both.
    """

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: KVProjection | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]: ...


class PagedBlock(Protocol):
    """A decoder block that attends through the pages (every layer's, seen flat, which its
    metadata's tables address) and hands them back updated."""

    def __call__(
        self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Every layer's K and V pages, each `[layers, num_blocks + 1, block_size, kv_heads,
    head_dim]`.

    One array across the layers, which the model's layer loop (`run_blocks`) carries: seen
    flat (`[layers * (num_blocks + 1), ...]`), layer `l`'s block `b` is block
    `l * (num_blocks + 1) + b`, so every layer writes and reads the one pool in place through
    its own offset tables and no layer's pages are sliced out (slicing them copied them on
    XLA:CPU). The extra last block of each layer is a scratch slot for padding tokens.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype,
              staging_blocks: int = 0, sharding: jax.sharding.Sharding | None = None) -> KVCache:
        """`staging_blocks` more blocks per layer after the engine's `num_blocks`, where a
        runner computes K/V that go straight to host memory (LayerKV's offloaded layers).
        `sharding`: where each page array is made (tensor parallelism: split by KV head)."""
        shape = (cfg.num_layers, num_blocks + staging_blocks + 1, block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype, device=sharding), v=jnp.zeros(shape, dtype, device=sharding))

    @property
    def blocks_per_layer(self) -> int:
        return self.k.shape[1]

    @property
    def scratch_block(self) -> int:
        return self.k.shape[1] - 1

    def flat_ids(self, ids: jax.Array | np.ndarray, layer: int | None = None) -> jax.Array | np.ndarray:
        """Blocks `ids` as blocks of the pool seen flat (`flat`): layer `layer`'s, or every
        layer's, layer by layer (`[layers * len(ids)]`)."""
        if layer is not None:
            return ids + layer * self.blocks_per_layer
        xp = np if isinstance(ids, np.ndarray) else jnp
        first = xp.arange(self.k.shape[0], dtype=ids.dtype)[:, None] * self.blocks_per_layer
        return (first + ids[None]).reshape(-1)

    def flat(self) -> tuple[jax.Array, jax.Array]:
        """The K and V pools as `[layers * (num_blocks + 1), block_size, kv_heads, head_dim]`
        (a reshape: no copy)."""
        return (self.k.reshape(-1, *self.k.shape[2:]), self.v.reshape(-1, *self.v.shape[2:]))

    def of_flat(self, k: jax.Array, v: jax.Array) -> KVCache:
        """A cache of this shape from flat pools (`flat`)."""
        return KVCache(k.reshape(self.k.shape), v.reshape(self.v.shape))


@functools.cache
def block_copies(gather_blocks: Callable, scatter_blocks: Callable) -> tuple[Callable, Callable]:
    """(gather, donated scatter) of K and V blocks at ids of the pool seen flat (`flat_ids`):
    `gather(cache, ids) -> (k, v)`, `scatter(cache, ids, k, v) -> cache`, writing only those
    blocks. Swaps pass every layer's ids of a request, LayerKV's offloads one layer's; made
    once per backend's copy functions, so engines built again in a process reuse the
    compiled copies."""
    def gather(cache: KVCache, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = cache.flat()
        return gather_blocks(k, ids), gather_blocks(v, ids)

    def scatter(cache: KVCache, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        flat_k, flat_v = cache.flat()
        return cache.of_flat(scatter_blocks(flat_k, ids, k), scatter_blocks(flat_v, ids, v))

    return jax.jit(gather), jax.jit(scatter, donate_argnums=0)


def stacked_blocks(make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: Any) -> nnx.Module:
    """`num_layers` blocks as one module whose parameters carry a leading layer axis, the
    form `run_blocks` loops over; layer `l` is initialised from the `l`-th of `num_layers`
    keys split from `rngs.params()`."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), num_layers)
    return nnx.merge(graphdef, jax.vmap(lambda key: nnx.state(make(nnx.Rngs(key))))(keys))


def is_stacked(path: tuple) -> bool:
    """Whether the parameter at `path` (in a model's `nnx.State`) is one of the stacked
    blocks' (`[layers, ...]`): the models keep `stacked_blocks` at their `layers`."""
    first = path[0]
    return getattr(first, "key", getattr(first, "name", None)) == "layers"


def run_blocks(
    blocks: nnx.Module, x: jax.Array, cache: KVCache, meta: AttentionMetadata,
    attention: AttentionFn,
) -> tuple[jax.Array, KVCache]:
    """Thread the residual stream through every layer of `blocks` (`stacked_blocks`).

    One `lax.scan` over the stacked parameters, so a step program holds one copy of the
    layer whatever the depth (it compiled in a third of the time of the unrolled layers and
    stepped as fast: `bench/layer_loop.py`). The pools are carried flat; each layer writes
    and reads through its own offset tables (`AttentionMetadata.for_layer`), so a block
    (`PagedBlock`) and the attention backend see one pool and never know the layer.
    """
    graphdef, state = nnx.split(blocks)
    pages = cache.k.shape[1:]
    meta = jax.tree.map(jnp.asarray, meta)  # host-side metadata, indexed by traced values

    def layer(carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[nnx.State, jax.Array]):
        x, k, v = carry
        params, index = xs
        return nnx.merge(graphdef, params)(x, k, v, meta.for_layer(index, pages), attention), None

    num_layers = cache.k.shape[0]
    (x, k, v), _ = jax.lax.scan(layer, (x, *cache.flat()), (state, jnp.arange(num_layers)))
    return x, cache.of_flat(k, v)
