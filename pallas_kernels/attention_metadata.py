"""The ragged batch description every attention kernel and its reference read.

A step's tokens lie on one flat axis: sequence `s` owns tokens
`query_start[s]:query_start[s+1]`, the last `query_len` tokens of its `context_lens[s]`
tokens of context. Prefill chunks and decodes mix freely; padding tokens sit after
`query_start[-1]` and write their K/V into a scratch slot that no sequence reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # [T] int32: position of each token within its sequence
    slot_mapping: jax.Array  # [T] int32: block * block_size + offset where its K/V is written
    query_start: jax.Array  # [S + 1] int32: cumulative query lengths; padded sequences are empty
    context_lens: jax.Array  # [S] int32: cached + new tokens each sequence attends to
    block_tables: jax.Array  # [S, max_blocks_per_seq] int32: physical block of each logical block
    # Static: every real sequence has exactly one query token. Lets a backend pick its
    # decode kernel at trace time; a different value is a different compiled step.
    decode_only: bool = field(default=False, metadata=dict(static=True))
