"""Ragged paged attention: prefill chunks and decodes of many sequences in one call.

`ragged_paged_attention` is the Pallas (Triton) kernel; `ragged_paged_attention_reference`
is its jnp oracle with the same signature, and the path XLA:CPU runs well.

The jnp reference splits each token's keys in two and merges them with an online softmax:

- the step's own tokens (read back from their freshly written slots), attended causally
  within the same sequence, tile by tile, visiting only key tiles that can hold the same
  sequence; this is all a step of fresh prompts needs;
- the already-cached prefix of the token's sequence, walked one page at a time in a
  `fori_loop` whose trip count is the longest prefix in the batch.

Walking pages keeps every temporary a single page per token. On XLA:CPU, gathering whole
contexts (`[T, context, kv_heads, d]`) and contracting them with einsum measured about 6x
slower per layer at batch 64 and 1k context than this loop with multiply-reduce products
that XLA fuses; and a bound that is data rather than shape means no recompilation as
contexts grow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.attention_tiles import (
    check_head_dim, compiler_params, gather, online_softmax_over_keys, paged_kv_loader, scatter,
)

_MASKED = -1e30
_TILE = 128  # query/key tile of the in-step causal part


def _tiles(x: jax.Array, num_tiles: int) -> jax.Array:
    """[T, kv, d] -> [tiles, kv, tile, d]."""
    t, kv, d = x.shape
    return x.reshape(num_tiles, t // num_tiles, kv, d).transpose(0, 2, 1, 3)


def sequence_of_tokens(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of each flat token; padding tokens get `num_seqs` (no sequence)."""
    return jnp.searchsorted(query_start[1:], jnp.arange(num_tokens), side="right").astype(jnp.int32)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: AttentionMetadata,
    *,
    scale: float,
) -> jax.Array:
    """Attention of `q: [T, heads, d]` over paged K/V `[blocks, block_size, kv_heads, d]`.

    The step's K/V must already be written at `meta.slot_mapping`. Returns `[T, heads, d]`
    in `q`'s dtype; padding tokens get finite garbage that callers drop.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    num_seqs = meta.context_lens.shape[0]
    f32 = jnp.float32

    seq = sequence_of_tokens(meta.query_start, num_tokens)
    real = seq < num_seqs
    seq_c = jnp.minimum(seq, num_seqs - 1)
    query_lens = meta.query_start[1:] - meta.query_start[:-1]
    prefix_lens = jnp.where(real, (meta.context_lens - query_lens)[seq_c], 0)  # [T]
    pos = meta.positions

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(f32) * scale

    # The step's own tokens, causal within each sequence, in tiles of `tile` tokens: query
    # tile i meets key tiles i, i-1, ... back to the tile where its first token's sequence
    # starts, so a step of many short prompts does a few tile products, not a [T, T] one.
    flat_k = k_pages.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_pages.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    tile = min(num_tokens, _TILE)
    num_tiles = num_tokens // tile
    k_new = _tiles(flat_k[meta.slot_mapping].astype(f32), num_tiles)  # [n, kv, tile, d]
    v_new = _tiles(flat_v[meta.slot_mapping].astype(f32), num_tiles)
    q_t = qg.reshape(num_tiles, tile, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    seq_t, pos_t = seq.reshape(num_tiles, tile), pos.reshape(num_tiles, tile)
    tile_ids = jnp.arange(num_tiles)
    first_tile = jnp.where(real, meta.query_start[seq_c], jnp.arange(num_tokens)) // tile
    back = tile_ids - first_tile.reshape(num_tiles, tile)[:, 0]  # key tiles before the diagonal

    def key_tile(d: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        j = jnp.maximum(tile_ids - d, 0)
        s = jnp.einsum("ikqgd,ikcd->ikqgc", q_t, k_new[j])  # [n, kv, tile, group, tile]
        own = (seq_t[:, :, None] == seq_t[j][:, None, :]) & (
            pos_t[j][:, None, :] <= pos_t[:, :, None]) & (d <= back)[:, None, None]
        s = jnp.where(own[:, None, :, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        e = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("ikqgc,ikcd->ikqgd", e, v_new[j])
        return m_new, l * alpha + e.sum(axis=-1), acc * alpha[..., None] + pv

    shape = (num_tiles, num_kv_heads, tile, group)
    init = (jnp.full(shape, _MASKED, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, head_dim), f32))
    m, l, acc = jax.lax.fori_loop(0, back.max() + 1, key_tile, init)
    # Back to token-major [T, kv, group(, d)] for the page walk.
    m, l = (x.transpose(0, 2, 1, 3).reshape(num_tokens, num_kv_heads, group) for x in (m, l))
    acc = acc.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_kv_heads, group, head_dim)

    # The cached prefix, one page per iteration, merged by online softmax.
    tables = meta.block_tables[seq_c]  # [T, max_blocks]
    offsets = jnp.arange(block_size)

    def page(p: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        blocks = tables[:, p]
        k = k_pages[blocks].astype(f32)  # [T, block_size, kv_heads, d]
        v = v_pages[blocks].astype(f32)
        s = (qg[:, None] * k[:, :, :, None, :]).sum(-1)  # [T, block_size, kv_heads, group]
        valid = (p * block_size + offsets)[None, :] < prefix_lens[:, None]
        s = jnp.where(valid[:, :, None, None], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        e = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = (e[..., None] * v[:, :, :, None, :]).sum(axis=1)
        return m_new, l * alpha + e.sum(axis=1), acc * alpha[..., None] + pv

    num_pages = (prefix_lens.max() + block_size - 1) // block_size
    m, l, acc = jax.lax.fori_loop(0, num_pages, page, (m, l, acc))
    out = acc / l[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------- Pallas kernel


def row_tiles(query_start: jax.Array, group: int, block_m: int, num_tokens: int
              ) -> tuple[jax.Array, jax.Array]:
    """The kernel's work list: `(sequence, first row)` of each tile of `block_m` query rows.

    A query row is one (token, query head of a KV group) pair, so a KV head's `group` query
    heads share every K/V tile they load. Tiles never straddle sequences. The list has a
    static length (the most tiles any batch of this shape can need); unused entries carry
    sequence `S`, which the kernel skips.
    """
    num_seqs = query_start.shape[0] - 1
    rows = (query_start[1:] - query_start[:-1]) * group
    tiles = -(-rows // block_m)
    ends = jnp.cumsum(tiles)
    w = jnp.arange(-(-num_tokens * group // block_m) + num_seqs)
    seq = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)
    first_tile = (ends - tiles)[jnp.minimum(seq, num_seqs - 1)]
    return seq, ((w - first_tile) * block_m).astype(jnp.int32)


def attend_row_tile(q_ref, o_ref, start_ref, ctx_ref, tile_seq_ref, tile_row_ref,
                    make_loader, *, group: int, head_dim: int, block_m: int, block_k: int,
                    scale: float) -> None:
    """One program: a tile of query rows of one sequence and one KV head, against all the keys
    its rows may see. `make_loader(seq, kv_head)` says where K/V tiles come from."""
    w, kv_head = pl.program_id(0), pl.program_id(1)
    seq = tile_seq_ref[w]

    @pl.when(seq < ctx_ref.shape[0])
    def _():
        q_start, q_end, ctx = start_ref[seq], start_ref[seq + 1], ctx_ref[seq]
        prefix = ctx - (q_end - q_start)
        first_row = tile_row_ref[w]
        r = first_row + jnp.arange(block_m)
        valid = r < (q_end - q_start) * group
        token, head = q_start + r // group, kv_head * group + r % group
        cols = jnp.arange(head_dim)
        idx = (token[:, None], head[:, None], cols[None, :])
        q = gather(q_ref, valid[:, None], *idx)
        end_key = jnp.minimum(prefix + (first_row + block_m - 1) // group + 1, ctx)
        state = online_softmax_over_keys(q, prefix + r // group, 0, end_key,
                                         make_loader(seq, kv_head), scale=scale, block_k=block_k)
        scatter(o_ref, state.output().astype(o_ref.dtype), valid[:, None], *idx)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: AttentionMetadata,
    *,
    scale: float,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """Pallas version of `ragged_paged_attention_reference` (same signature and result).

    One program per (tile of `block_m` query rows of one sequence, KV head). It walks the
    sequence's keys up to its last row's position, cached prefix and the step's own tokens
    alike (both are already in the pages), so prefill chunks and decodes need no separate
    paths. Padding tokens' outputs are zeros.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    tile_seq, tile_row = row_tiles(meta.query_start, group, block_m, num_tokens)
    flat = (num_blocks * block_size, num_kv_heads, head_dim)

    def loader(table_ref, k_ref, v_ref):
        return lambda seq, kv_head: paged_kv_loader(table_ref, k_ref, v_ref, seq, kv_head,
                                                    head_dim, block_size)

    def kernel(q_ref, k_ref, v_ref, start_ref, ctx_ref, table_ref, seq_ref, row_ref, _, o_ref):
        attend_row_tile(q_ref, o_ref, start_ref, ctx_ref, seq_ref, row_ref,
                        loader(table_ref, k_ref, v_ref), group=group, head_dim=head_dim,
                        block_m=block_m, block_k=block_k, scale=scale)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tile_seq.shape[0], num_kv_heads),
        input_output_aliases={8: 0},  # zeros in, so rows no tile covers read back as 0
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="ragged_paged_attention",
    )(q, k_pages.reshape(flat), v_pages.reshape(flat), meta.query_start, meta.context_lens,
      meta.block_tables, tile_seq, tile_row, jnp.zeros_like(q))
