"""Move whole KV blocks between the device pool and a contiguous buffer.

Swapping a preempted request out (and LayerKV's per-layer offload) gathers its blocks into
one `[n, block_size, ...]` buffer, which `jax.device_put` then moves to host memory in a
single transfer; swapping in scatters a buffer back into (possibly different) free blocks.
Under a jit that donates the pool, the scatter writes only the target blocks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jserve.pallas_kernels.row_copy import copy_rows


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def gather_blocks_reference(pool: jax.Array, block_ids: jax.Array) -> jax.Array:
    """`pool[block_ids]`: the listed blocks, in order, as one buffer."""
    return pool[block_ids]


def scatter_blocks_reference(pool: jax.Array, block_ids: jax.Array, blocks: jax.Array) -> jax.Array:
    """`pool` with `pool[block_ids[i]] = blocks[i]`."""
    return pool.at[block_ids].set(blocks.astype(pool.dtype))


def _copy(copy, src: jax.Array, src_ids: jax.Array, dst: jax.Array, dst_ids: jax.Array) -> jax.Array:
    return copy(_rows(src), src_ids, _rows(dst), dst_ids).reshape(dst.shape)


def gather_blocks(pool: jax.Array, block_ids: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Pallas version of `gather_blocks_reference`."""
    out = jnp.empty((block_ids.shape[0], *pool.shape[1:]), pool.dtype)
    index = jnp.arange(block_ids.shape[0], dtype=block_ids.dtype)
    return _copy(partial(copy_rows, interpret=interpret), pool, block_ids, out, index)


def scatter_blocks(pool: jax.Array, block_ids: jax.Array, blocks: jax.Array, *,
                   interpret: bool = False) -> jax.Array:
    """Pallas version of `scatter_blocks_reference`."""
    index = jnp.arange(block_ids.shape[0], dtype=block_ids.dtype)
    return _copy(partial(copy_rows, interpret=interpret), blocks, index, pool, block_ids)
