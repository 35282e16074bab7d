"""In-kernel building blocks shared by the Pallas attention kernels.

Every attention kernel here walks a sequence's keys in tiles of `block_k` logical
positions. A tile's K/V rows are gathered slot by slot through the block table (one
pointer per row, each row a contiguous `head_dim` vector), so a tile may span pages and the
page size need not be a power of two or divide the tile. What differs between kernels is
only where a tile's K/V come from (paged K/V, or hidden states projected on the fly) and
which queries meet it; `online_softmax_over_keys` is the loop they share.

All of this runs inside a `pallas_call` on the Triton backend, or interpreted on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASKED = -1e30  # finite, so a fully masked row gives finite garbage rather than NaN

# (keys [block_k] int32 logical positions, valid [block_k] bool) -> K, V tiles [block_k, d]
TileLoader = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_head_dim(head_dim: int) -> None:
    """Triton tiles are powers of two and its dots need every side >= 16."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Pallas attention kernels need head_dim a power of two >= 16, "
                         f"got {head_dim}; use attention='reference'")


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> plgpu.CompilerParams:
    """Triton launch parameters; passing them is also what selects the Triton backend on GPU
    (without them JAX lowers GPU kernels with Mosaic GPU, which needs sm_90)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` accumulated in float32; full fp32 precision for fp32 inputs (no TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def slots_of_keys(table_ref, seq: jax.Array, keys: jax.Array, valid: jax.Array,
                  block_size: int) -> jax.Array:
    """Flat pool slot of each logical key position of sequence `seq`."""
    blocks = gather(table_ref, valid, seq, keys // block_size)
    return blocks * block_size + keys % block_size


def gather(ref, mask: jax.Array, *index: jax.Array | int) -> jax.Array:
    """`ref[index]` with broadcasting integer-array indices; masked-out elements read as 0
    and touch no memory."""
    return plgpu.load(ref.at[index], mask=mask, other=0)


def scatter(ref, value: jax.Array, mask: jax.Array, *index: jax.Array | int) -> None:
    """`ref[index] = value` where `mask`, with broadcasting integer-array indices."""
    plgpu.store(ref.at[index], value, mask=mask)


def paged_kv_loader(table_ref, k_ref, v_ref, seq: jax.Array, kv_head: jax.Array,
                    head_dim: int, block_size: int) -> TileLoader:
    """K/V tiles of one KV head read from pools viewed as `[slots, kv_heads, d]`."""
    cols = jnp.arange(head_dim)

    def load(keys: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        slots = slots_of_keys(table_ref, seq, keys, valid, block_size)
        idx = (slots[:, None], kv_head, cols[None, :])
        return gather(k_ref, valid[:, None], *idx), gather(v_ref, valid[:, None], *idx)

    return load


@dataclass(frozen=True)
class SoftmaxState:
    """Running max, normaliser and unnormalised output of an online softmax over key tiles."""

    m: jax.Array  # [M]
    l: jax.Array  # [M]
    acc: jax.Array  # [M, d] float32

    @classmethod
    def empty(cls, rows: int, head_dim: int) -> SoftmaxState:
        return cls(jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
                   jnp.zeros((rows, head_dim), jnp.float32))

    def output(self) -> jax.Array:
        """Normalised output; rows that saw no key get 0 instead of 0/0."""
        return self.acc / jnp.where(self.l > 0, self.l, 1.0)[:, None]


def online_softmax_over_keys(
    q: jax.Array,  # [M, d]
    q_pos: jax.Array,  # [M]: a query sees keys at positions <= its own
    first_key: jax.Array,
    end_key: jax.Array,  # keys [first_key, end_key) are walked
    load: TileLoader,
    *,
    scale: float,
    block_k: int,
) -> SoftmaxState:
    """Fold keys `[first_key, end_key)` into the softmax state tile by tile (flash-attention's
    recurrence), with the causal mask `key <= q_pos`."""
    rows, head_dim = q.shape
    state = SoftmaxState.empty(rows, head_dim)
    offsets = jnp.arange(block_k)

    def tile(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        keys = first_key + i * block_k + offsets
        valid = keys < end_key
        k, v = load(keys, valid)
        s = dot(q, k.astype(q.dtype).T) * scale
        visible = valid[None, :] & (keys[None, :] <= q_pos[:, None])
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return m_new, l * alpha + p.sum(axis=1), acc

    num_tiles = pl.cdiv(jnp.maximum(end_key - first_key, 0), block_k)
    m, l, acc = jax.lax.fori_loop(0, num_tiles, tile, (state.m, state.l, state.acc))
    return SoftmaxState(m, l, acc)
