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
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.attention_tiles import (
    MASKED as _MASKED, check_head_dim, TileLoader, compiler_params, dot, gather,
)
from jserve.pallas_kernels.ragged_paged_attention import attend_row_tile, row_tiles, sequence_of_tokens
from jserve.pallas_kernels.rope import Llama3RopeScaling, inverse_frequencies, rope


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVProjection:
    """A layer's K/V projection: `k = rope(h @ wk + bk)`, `v = h @ wv + bv`."""

    wk: jax.Array  # [hidden, kv_heads * head_dim]
    wv: jax.Array
    bk: jax.Array | None = None  # [kv_heads * head_dim] (OPT); None: no bias (Llama)
    bv: jax.Array | None = None
    rope_theta: float | None = field(default=None, metadata=dict(static=True))  # None: no RoPE
    rope_scaling: Llama3RopeScaling | None = field(default=None, metadata=dict(static=True))

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
        k = rope(k, positions, proj.rope_theta, proj.rope_scaling)
    return k, v


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HiddenPool:
    """Where hidden rows live. A sequence's logical block `j` holds `block_tokens =
    rows_per_page * len(pages)` tokens: its first `rows_per_page` rows at the start of page
    0 of physical block `table[j]`, the next ones at the start of page 1, and so on. Each
    page array is `[blocks, ...]` with `page_size` values per block, of which the first
    `rows_per_page * hidden` hold rows. A dedicated pool `[blocks, block_size, hidden]` is
    one page of `block_size` rows; Apt-Serve's unified pool (Section 4.3) lays a hidden
    block's rows in the block's K page, then its V page (`in_kv_pages`)."""

    pages: tuple[jax.Array, ...]
    rows_per_page: int = field(metadata=dict(static=True))
    hidden: int = field(metadata=dict(static=True))

    @classmethod
    def of(cls, pool: jax.Array | HiddenPool) -> HiddenPool:
        """`pool` itself, or a dedicated `[blocks, block_size, hidden]` array as one page."""
        if isinstance(pool, HiddenPool):
            return pool
        return cls((pool,), pool.shape[1], pool.shape[2])

    @classmethod
    def in_kv_pages(cls, k_pages: jax.Array, v_pages: jax.Array, hidden: int) -> HiddenPool:
        """Rows in the K page then the V page of KV blocks `[blocks, block_size, kv_heads, d]`:
        `floor(block_size * kv_heads * d / hidden)` rows per page."""
        rows = math.prod(k_pages.shape[1:]) // hidden
        if rows < 1:
            raise ValueError(f"a page of {math.prod(k_pages.shape[1:])} values holds no hidden row "
                             f"of {hidden}")
        return cls((k_pages, v_pages), rows, hidden)

    @property
    def block_tokens(self) -> int:
        return self.rows_per_page * len(self.pages)

    @property
    def page_size(self) -> int:
        return math.prod(self.pages[0].shape[1:])

    def rows(self, blocks: jax.Array) -> jax.Array:
        """Hidden rows `[n, block_tokens, hidden]` of physical blocks `[n]` (only those read)."""
        used = self.rows_per_page * self.hidden
        return jnp.concatenate(
            [page[blocks].reshape(blocks.shape[0], -1)[:, :used].reshape(-1, self.rows_per_page, self.hidden)
             for page in self.pages], axis=1)


def write_hidden_rows(pool: HiddenPool, rows: jax.Array, offsets: Sequence[jax.Array]) -> HiddenPool:
    """`pool` with row `t` of `rows: [T, hidden]` written at element `offsets[p][t]` of page
    `p` (flat); a token whose row goes to another page points at a scratch block's row."""
    cols = jnp.arange(pool.hidden, dtype=jnp.int32)
    pages = tuple(page.reshape(-1).at[off[:, None] + cols[None, :]].set(rows.astype(page.dtype))
                  .reshape(page.shape) for page, off in zip(pool.pages, offsets, strict=True))
    return dataclasses.replace(pool, pages=pages)


def hidden_paged_attention_reference(
    q: jax.Array, pool: jax.Array | HiddenPool, proj: KVProjection, meta: AttentionMetadata, *,
    scale: float,
) -> jax.Array:
    """Attention of `q: [T, heads, d]` over K/V projected from each sequence's hidden rows.

    Walks the sequences' logical blocks one at a time (a `fori_loop` whose trip count is
    the longest context in blocks): each iteration gathers that block of every sequence
    (through `meta.block_tables`, nothing else of the pool), projects it once per sequence
    and folds it into every token's online softmax with the causal mask. The step's own rows
    must already be written, so the walk covers cached and new tokens alike. Padding tokens
    get zeros."""
    pool = HiddenPool.of(pool)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.block_tables.shape[0]
    num_kv_heads = proj.wk.shape[1] // head_dim
    group = num_heads // num_kv_heads
    width = pool.block_tokens
    f32 = jnp.float32
    seq = sequence_of_tokens(meta.query_start, num_tokens)
    real = seq < num_seqs
    seq_c = jnp.minimum(seq, num_seqs - 1)
    ctx = jnp.where(real, meta.context_lens[seq_c], 0)  # [T]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(f32) * scale
    offsets = jnp.arange(width)

    def block(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        keys = j * width + offsets  # [width] logical positions
        rows = pool.rows(meta.block_tables[:, j]).reshape(num_seqs * width, pool.hidden)
        k, v = project_kv(rows, proj, jnp.tile(keys, num_seqs), head_dim)
        k = k.reshape(num_seqs, width, num_kv_heads, head_dim)[seq_c].astype(f32)  # [T, width, kv, d]
        v = v.reshape(num_seqs, width, num_kv_heads, head_dim)[seq_c].astype(f32)
        s = (qg[:, None] * k[:, :, :, None, :]).sum(-1)  # [T, width, kv_heads, group]
        visible = (keys[None, :] <= meta.positions[:, None]) & (keys[None, :] < ctx[:, None])
        s = jnp.where(visible[:, :, None, None], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        e = jnp.where(visible[:, :, None, None], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = (e[..., None] * v[:, :, :, None, :]).sum(axis=1)
        return m_new, l * alpha + e.sum(axis=1), acc * alpha[..., None] + pv

    shape = (num_tokens, num_kv_heads, group)
    init = (jnp.full(shape, _MASKED, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, head_dim), f32))
    m, l, acc = jax.lax.fori_loop(0, (ctx.max() + width - 1) // width, block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def hidden_kv_loader(table_ref, page_refs, wk_ref, wv_ref, bk_ref, bv_ref, freq_ref,
                     seq: jax.Array, kv_head: jax.Array, *, head_dim: int, pool: HiddenPool,
                     block_d: int, rope: bool) -> TileLoader:
    """K/V tiles of one KV head computed from hidden rows, `block_d` columns at a time. Row
    of key `p`: row `p % block_tokens % rows_per_page` of page `p % block_tokens //
    rows_per_page` of block `table[p // block_tokens]`, read from the flat pages."""
    hidden, rows_per_page, width = pool.hidden, pool.rows_per_page, pool.block_tokens
    cols = jnp.arange(head_dim)
    w_cols = kv_head * head_dim + cols
    # rotate_half(k)[c] = -k[c + d/2] for c < d/2, else k[c - d/2]
    r_cols = kv_head * head_dim + (cols + head_dim // 2) % head_dim
    sign = jnp.where(cols < head_dim // 2, -1.0, 1.0)

    def load(keys: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        blocks = gather(table_ref, valid, seq, keys // width)
        within = keys % width
        page = within // rows_per_page
        base = blocks * pool.page_size + (within % rows_per_page) * hidden

        def chunk(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            k, k_rot, v = carry
            d_idx = c * block_d + jnp.arange(block_d)
            d_ok = d_idx < hidden
            x = sum(gather(ref, (valid & (page == p))[:, None] & d_ok[None, :], base[:, None] + d_idx[None, :])
                    for p, ref in enumerate(page_refs))
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
        dtype = page_refs[0].dtype
        return k.astype(dtype), v.astype(dtype)

    return load


def hidden_paged_attention(
    q: jax.Array,
    pool: jax.Array | HiddenPool,
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
    each computing its K/V tiles from the hidden rows of `pool` (a `HiddenPool`, or a
    dedicated `[blocks, block_size, hidden]` array)."""
    pool = HiddenPool.of(pool)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = proj.wk.shape[1] // head_dim
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    tile_seq, tile_row = row_tiles(meta.query_start, group, block_m, num_tokens)
    use_rope = proj.rope_theta is not None
    freq = inverse_frequencies(head_dim, proj.rope_theta if use_rope else 1.0, proj.rope_scaling)
    bk, bv = proj.biases()
    num_pages = len(pool.pages)

    def kernel(q_ref, *refs):
        page_refs = refs[:num_pages]
        (wk_ref, wv_ref, bk_ref, bv_ref, freq_ref, start_ref, ctx_ref, table_ref, seq_ref,
         row_ref, _, o_ref) = refs[num_pages:]

        def make_loader(seq: jax.Array, kv_head: jax.Array) -> TileLoader:
            return hidden_kv_loader(table_ref, page_refs, wk_ref, wv_ref, bk_ref, bv_ref, freq_ref,
                                    seq, kv_head, head_dim=head_dim, pool=pool, block_d=block_d,
                                    rope=use_rope)

        attend_row_tile(q_ref, o_ref, start_ref, ctx_ref, seq_ref, row_ref, make_loader,
                        group=group, head_dim=head_dim, block_m=block_m, block_k=block_k,
                        scale=scale)

    inputs = (q, *(page.reshape(-1) for page in pool.pages), proj.wk, proj.wv, bk, bv, freq,
              meta.query_start, meta.context_lens, meta.block_tables, tile_seq, tile_row,
              jnp.zeros_like(q))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tile_seq.shape[0], num_kv_heads),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="hidden_paged_attention",
    )(*inputs)
