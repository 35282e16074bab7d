"""Paged attention for steps in which every sequence has exactly one query token.

Decode is bound by reading K/V, and one program per (sequence, KV head) would leave most of
a GPU idle for small batches of long contexts. So the keys are split (split-K, as in
FlashDecoding): one program per (sequence, KV head, split of `keys_per_split` keys), each
leaving a partial softmax state, merged afterwards by a cheap jnp reduction. The KV head's
`group` query heads are the rows of one tile, so each K/V tile is loaded once per group.

`paged_decode_attention_reference` is the ragged reference (a decode is its special case),
under the name and signature of this kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.attention_tiles import (
    MASKED, SoftmaxState, TileLoader, check_head_dim, compiler_params, gather, next_pow2,
    online_softmax_over_keys, paged_kv_loader,
)
from jserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

paged_decode_attention_reference = ragged_paged_attention_reference


def merge_splits(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:
    """Combine partial softmax states over the split axis (-2 of m/l, -3 of acc).

    Splits that saw no key have l = 0 and drop out; a row no split saw (a padded sequence)
    comes out 0 rather than 0/0.
    """
    m_all = m.max(axis=-2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)
    num = (w[..., None] * acc).sum(axis=-3)
    den = (w * l).sum(axis=-2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def one_row_softmax_over_keys(q: jax.Array, first_key: jax.Array, end_key: jax.Array,
                              load: TileLoader, *, scale: float, block_k: int) -> SoftmaxState:
    """`online_softmax_over_keys` for a single query row `q: [1, d]` that sees every key in
    `[first_key, end_key)` (a decode without GQA), with multiply-reduce products on the CUDA
    cores instead of tensor-core dots, which need 16 rows and stage K/V in shared memory."""
    f32 = jnp.float32
    offsets = jnp.arange(block_k)
    q = q.astype(f32)

    def tile(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry  # [1], [1], [1, d]
        keys = first_key + i * block_k + offsets
        valid = keys < end_key
        k, v = load(keys, valid)
        s = jnp.where(valid, jnp.sum(q * k.astype(f32), axis=1) * scale, MASKED)  # [block_k]
        m_new = jnp.maximum(m, s.max())
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.sum(p[:, None] * v.astype(f32), axis=0)  # [d]
        return m_new, l * alpha + p.sum(), acc * alpha[:, None] + pv[None, :]

    state = SoftmaxState.empty(1, q.shape[1])
    num_tiles = pl.cdiv(jnp.maximum(end_key - first_key, 0), block_k)
    m, l, acc = jax.lax.fori_loop(0, num_tiles, tile, (state.m, state.l, state.acc))
    return SoftmaxState(m, l, acc)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: AttentionMetadata,
    *,
    scale: float,
    block_k: int = 64,
    keys_per_split: int = 512,
    num_warps: int = 4,
    num_stages: int = 2,
    one_row: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Same result as the ragged kernel when each real sequence has one query token.

    `q: [T, heads, d]` with sequence `s`'s token at `query_start[s]`; tokens that belong to
    no sequence come out 0. The split count is static: enough splits of `keys_per_split`
    keys to cover the longest context the block tables can describe; splits past a
    sequence's context do no work. `one_row`: without GQA (one query head per KV head),
    use `one_row_softmax_over_keys` instead of 16-row tensor-core tiles.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_blocks = meta.block_tables.shape
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    one_row = one_row and group == 1
    rows = 1 if one_row else max(16, next_pow2(group))  # 16: the smallest tensor-core tile
    keys_per_split = -(-keys_per_split // block_k) * block_k
    num_splits = -(-max_blocks * block_size // keys_per_split)
    flat = (num_blocks * block_size, num_kv_heads, head_dim)

    def kernel(q_ref, k_ref, v_ref, start_ref, ctx_ref, table_ref, o_ref, m_ref, l_ref):
        seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        token, ctx = start_ref[seq], ctx_ref[seq]
        has_query = start_ref[seq + 1] > token
        g = jnp.arange(rows)
        cols = jnp.arange(head_dim)
        valid = (g < group) & has_query
        q = gather(q_ref, valid[:, None], token, (kv_head * group + g)[:, None], cols[None, :])
        first = split * keys_per_split
        end = jnp.where(has_query, jnp.minimum(first + keys_per_split, ctx), 0)
        load = paged_kv_loader(table_ref, k_ref, v_ref, seq, kv_head, head_dim, block_size)
        if one_row:
            state = one_row_softmax_over_keys(q, first, end, load, scale=scale, block_k=block_k)
        else:
            state = online_softmax_over_keys(q, jnp.full((rows,), ctx - 1), first, end, load,
                                             scale=scale, block_k=block_k)
        o_ref[seq, kv_head, split] = state.acc
        m_ref[seq, kv_head, split] = state.m
        l_ref[seq, kv_head, split] = state.l

    part = (num_seqs, num_kv_heads, num_splits, rows)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)),
        grid=(num_seqs, num_kv_heads, num_splits),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(q, k_pages.reshape(flat), v_pages.reshape(flat), meta.query_start, meta.context_lens,
      meta.block_tables)
    out = merge_splits(m, l, acc)[:, :, :group].reshape(num_seqs, num_heads, head_dim)
    # Padded sequences point at the real token count, which may be a padding token or past
    # the end; both are dropped or overwritten by nothing real.
    return jnp.zeros_like(q).at[meta.query_start[:-1]].set(out.astype(q.dtype), mode="drop")
