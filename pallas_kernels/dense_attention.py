"""Dense paged attention: every bound a shape, so the model can be differentiated through it.

Reverse-mode autodiff refuses the reference's loops, whose trip counts are read from the
batch (the longest cached prefix, the furthest key tile), and JVP refuses the Pallas
kernels, whose outputs alias their inputs. This path has no loop: it gathers every
sequence's whole block table (`[S, max_blocks * block_size]` keys) and scores each token
against all of them, masked to its own sequence's keys up to its own position, the way
packed-sequence training attends. Its cost is tokens x (sequences x table length) scores
per head, fine for training and scoring steps, not for serving, which has the reference
and the kernels. Same signature and values as `ragged_paged_attention_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.ragged_paged_attention import sequence_of_tokens

_MASKED = -1e30  # finite, so a padding token with no visible key still gets finite output


def dense_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: AttentionMetadata,
    *,
    scale: float,
) -> jax.Array:
    """Attention of `q: [T, heads, d]` over paged K/V `[blocks, block_size, kv_heads, d]`,
    the step's K/V already written at `meta.slot_mapping`. Returns `[T, heads, d]` in `q`'s
    dtype; padding tokens get finite garbage that callers drop."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_blocks = meta.block_tables.shape
    group = num_heads // num_kv_heads
    keys_per_seq = max_blocks * block_size
    f32 = jnp.float32

    def context(pages: jax.Array) -> jax.Array:  # [S * keys_per_seq, kv_heads, d]
        return pages[meta.block_tables].reshape(num_seqs * keys_per_seq, num_kv_heads,
                                                 head_dim).astype(f32)

    key_seq = jnp.repeat(jnp.arange(num_seqs), keys_per_seq)
    key_pos = jnp.tile(jnp.arange(keys_per_seq), num_seqs)
    seq = sequence_of_tokens(meta.query_start, num_tokens)  # padding: S, which no key has
    visible = (seq[:, None] == key_seq[None, :]) & (key_pos[None, :] <= meta.positions[:, None])

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(f32) * scale
    scores = jnp.einsum("tkgd,ckd->tkgc", qg, context(k_pages))
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
    out = jnp.einsum("tkgc,ckd->tkgd", jax.nn.softmax(scores, axis=-1), context(v_pages))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
