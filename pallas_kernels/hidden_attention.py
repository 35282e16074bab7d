"""Attention over a hidden-state cache (Apt-Serve's hybrid cache).

A request on the hidden cache stores, per layer, the activation its K/V projections read
(the layer input after the attention norm): `hidden_size` values per token instead of
`2 * kv_heads * head_dim`, at the price of recomputing K/V at every step. We cache the
normalised activation rather than the raw residual so that recomputation is a pure
projection (plus bias and RoPE): the norm needs no second pass over the row.

The kernel computes each K/V tile from its hidden rows inside the attention loop, so the
batch's dense K/V is never written to memory. RoPE's rotate-half is a column permutation
with signs, so the rotated K is a second product with permuted weight columns, and no
register tensor is ever sliced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.attention_tiles import (
    check_head_dim, TileLoader, compiler_params, dot, gather, slots_of_keys,
)
from pallas_kernels.ragged_paged_attention import (
    attend_row_tile, ragged_paged_attention_reference, row_tiles, sequence_of_tokens,
)
from pallas_kernels.rope import inverse_frequencies, rope


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVProjection:
    """A layer's K/V projection: `k = rope(h @ wk + bk)`, `v = h @ wv + bv`."""

    wk: jax.Array  # [hidden, kv_heads * head_dim]
    wv: jax.Array
    bk: jax.Array | None = None  # [kv_heads * head_dim] (OPT); None: no bias (Llama)
    bv: jax.Array | None = None
    rope_theta: float | None = field(default=None, metadata=dict(static=True))  # None: no RoPE

    def biases(self) -> tuple[jax.Array, jax.Array]:
        zero = jnp.zeros(self.wk.shape[1], self.wk.dtype)
        return (zero if self.bk is None else self.bk), (zero if self.bv is None else self.bv)


def project_kv(hidden: jax.Array, proj: KVProjection, positions: jax.Array, head_dim: int
               ) -> tuple[jax.Array, jax.Array]:
    """K/V `[N, kv_heads, d]` of hidden rows `[N, hidden]` at the given positions."""
    bk, bv = proj.biases()
    k = (hidden @ proj.wk + bk).reshape(hidden.shape[0], -1, head_dim)
    v = (hidden @ proj.wv + bv).reshape(hidden.shape[0], -1, head_dim)
    if proj.rope_theta is not None:
        k = rope(k, positions, proj.rope_theta)
    return k, v


def hidden_paged_attention_reference(
    q: jax.Array, hidden_pages: jax.Array, proj: KVProjection, meta: AttentionMetadata, *,
    scale: float,
) -> jax.Array:
    """Project every sequence's hidden pages to a dense K/V pool, then run the ragged
    reference over it. The step's hidden rows must already be written at `slot_mapping`."""
    num_seqs, max_blocks = meta.block_tables.shape
    _, block_size, hidden = hidden_pages.shape
    head_dim = q.shape[-1]
    keys = max_blocks * block_size
    rows = hidden_pages[meta.block_tables].reshape(num_seqs * keys, hidden)
    k, v = project_kv(rows, proj, jnp.tile(jnp.arange(keys), num_seqs), head_dim)
    pages = (num_seqs * max_blocks, block_size, *k.shape[1:])
    seq = jnp.minimum(sequence_of_tokens(meta.query_start, q.shape[0]), num_seqs - 1)
    dense = dataclasses.replace(
        meta,
        slot_mapping=seq * keys + meta.positions,
        block_tables=jnp.arange(num_seqs * max_blocks, dtype=jnp.int32).reshape(num_seqs, max_blocks),
    )
    return ragged_paged_attention_reference(q, k.reshape(pages), v.reshape(pages), dense,
                                            scale=scale)


def hidden_kv_loader(table_ref, hid_ref, wk_ref, wv_ref, bk_ref, bv_ref, freq_ref,
                     seq: jax.Array, kv_head: jax.Array, *, head_dim: int, block_size: int,
                     block_d: int, rope: bool) -> TileLoader:
    """K/V tiles of one KV head computed from hidden rows, `block_d` columns at a time."""
    hidden = hid_ref.shape[1]
    cols = jnp.arange(head_dim)
    w_cols = kv_head * head_dim + cols
    # rotate_half(k)[c] = -k[c + d/2] for c < d/2, else k[c - d/2]
    r_cols = kv_head * head_dim + (cols + head_dim // 2) % head_dim
    sign = jnp.where(cols < head_dim // 2, -1.0, 1.0)

    def load(keys: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        slots = slots_of_keys(table_ref, seq, keys, valid, block_size)

        def chunk(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            k, k_rot, v = carry
            d_idx = c * block_d + jnp.arange(block_d)
            d_ok = d_idx < hidden
            x = gather(hid_ref, valid[:, None] & d_ok[None, :], slots[:, None], d_idx[None, :])
            w_mask = d_ok[:, None]
            k = k + dot(x, gather(wk_ref, w_mask, d_idx[:, None], w_cols[None, :]))
            v = v + dot(x, gather(wv_ref, w_mask, d_idx[:, None], w_cols[None, :]))
            if rope:
                k_rot = k_rot + dot(x, gather(wk_ref, w_mask, d_idx[:, None], r_cols[None, :]))
            return k, k_rot, v

        zeros = jnp.zeros((keys.shape[0], head_dim), jnp.float32)
        k, k_rot, v = jax.lax.fori_loop(0, pl.cdiv(hidden, block_d), chunk, (zeros,) * 3)
        k = k + gather(bk_ref, cols < head_dim, w_cols).astype(jnp.float32)[None, :]
        v = v + gather(bv_ref, cols < head_dim, w_cols).astype(jnp.float32)[None, :]
        if rope:
            k_rot = k_rot + gather(bk_ref, cols < head_dim, r_cols).astype(jnp.float32)[None, :]
            angle = keys[:, None].astype(jnp.float32) * freq_ref[...][None, :]
            k = k * jnp.cos(angle) + k_rot * sign[None, :] * jnp.sin(angle)
        return k.astype(hid_ref.dtype), v.astype(hid_ref.dtype)

    return load


def hidden_paged_attention(
    q: jax.Array,
    hidden_pages: jax.Array,
    proj: KVProjection,
    meta: AttentionMetadata,
    *,
    scale: float,
    block_m: int = 64,
    block_k: int = 32,
    block_d: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """Pallas version of `hidden_paged_attention_reference`: the ragged kernel's programs,
    each computing its K/V tiles from `hidden_pages: [blocks, block_size, hidden]`."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, hidden = hidden_pages.shape
    num_kv_heads = proj.wk.shape[1] // head_dim
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    tile_seq, tile_row = row_tiles(meta.query_start, group, block_m, num_tokens)
    use_rope = proj.rope_theta is not None
    freq = inverse_frequencies(head_dim, proj.rope_theta if use_rope else 1.0)
    bk, bv = proj.biases()

    def kernel(q_ref, hid_ref, wk_ref, wv_ref, bk_ref, bv_ref, freq_ref, start_ref, ctx_ref,
               table_ref, seq_ref, row_ref, _, o_ref):
        def make_loader(seq: jax.Array, kv_head: jax.Array) -> TileLoader:
            return hidden_kv_loader(table_ref, hid_ref, wk_ref, wv_ref, bk_ref, bv_ref, freq_ref,
                                    seq, kv_head, head_dim=head_dim, block_size=block_size,
                                    block_d=block_d, rope=use_rope)

        attend_row_tile(q_ref, o_ref, start_ref, ctx_ref, seq_ref, row_ref, make_loader,
                        group=group, head_dim=head_dim, block_m=block_m, block_k=block_k,
                        scale=scale)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tile_seq.shape[0], num_kv_heads),
        input_output_aliases={12: 0},
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="hidden_paged_attention",
    )(q, hidden_pages.reshape(num_blocks * block_size, hidden), proj.wk, proj.wv, bk, bv, freq,
      meta.query_start, meta.context_lens, meta.block_tables, tile_seq, tile_row,
      jnp.zeros_like(q))
