"""The paged-attention interface between models and runners."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.hidden_attention import KVProjection


class AttentionFn(Protocol):
    """Write the step's new `k`, `v` `[T, kv_heads, d]` into the pages and attend with `q`.

    One call does both so that a backend may fuse the write into its kernel. Returns the
    attention output `[T, heads, d]` and the updated pages. `hidden` (the attention input
    rows `[T, hidden_size]`) and `proj` (the layer's K/V projection) are read only by the
    hidden cache's wrapper of a backend, for the sequences `meta.hidden` puts on Apt-Serve's
    hidden cache; a backend of paged KV ignores both.
    """

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: KVProjection | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]: ...


class PagedBlock(Protocol):
    """A decoder block that attends through one layer's pages and hands them back updated."""

    def __call__(
        self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Per-layer K/V pages, each `[num_blocks + 1, block_size, kv_heads, head_dim]`.

    One array per layer rather than one stacked `[layers, ...]` array: measured here on
    XLA:CPU, a step that indexes a stacked pool per layer copied the whole pool and ran
    about 6x slower at batch 64. The extra last block is a scratch slot for padding tokens.
    """

    k: list[jax.Array]
    v: list[jax.Array]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype,
              staging_blocks: int = 0, sharding: jax.sharding.Sharding | None = None) -> KVCache:
        """`staging_blocks` more blocks per layer after the engine's `num_blocks`, where a
        runner computes K/V that go straight to host memory (LayerKV's offloaded layers).
        `sharding`: where each page array is made (tensor parallelism: split by KV head)."""
        shape = (num_blocks + staging_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(
            k=[jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_layers)],
        )

    @property
    def scratch_block(self) -> int:
        return self.k[0].shape[0] - 1


@partial(jax.jit, static_argnums=(0, 6))
def _run_block(
    graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, k_pages: jax.Array,
    v_pages: jax.Array, meta: AttentionMetadata, attention: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block as a nested jit. A model's blocks share their structure and shapes, so a
    traced step traces and lowers the block once instead of once per layer (per-layer
    tracing was most of the second or so each step bucket took before XLA saw it); XLA
    inlines the calls again, so the compiled step, and its outputs, are unchanged."""
    return nnx.merge(graphdef, state)(x, k_pages, v_pages, meta, attention)


def run_blocks(
    blocks: Sequence[PagedBlock], x: jax.Array, cache: KVCache, meta: AttentionMetadata,
    attention: AttentionFn,
) -> tuple[jax.Array, KVCache]:
    """Thread the residual stream through every block, each with its own layer's pages.

    Families differ inside their blocks, not in how the cache is threaded, so they share this.
    Blocks are stateless nnx Modules, each run as a nested jit (`_run_block`); `attention`
    is a static argument of it, so it must be hashable. Each layer reads its own tables
    where the metadata has per-layer ones (`AttentionMetadata.for_layer`).
    """
    k_out, v_out = [], []
    for layer, (block, k_pages, v_pages) in enumerate(zip(blocks, cache.k, cache.v, strict=True)):
        graphdef, state = nnx.split(block)
        x, k_pages, v_pages = _run_block(graphdef, state, x, k_pages, v_pages, meta.for_layer(layer),
                                         attention)
        k_out.append(k_pages)
        v_out.append(v_pages)
    return x, KVCache(k=k_out, v=v_out)
