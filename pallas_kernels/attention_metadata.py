"""The ragged batch description every attention kernel and its reference read.

A step's tokens lie on one flat axis: sequence `s` owns tokens
`query_start[s]:query_start[s+1]`, the last `query_len` tokens of its `context_lens[s]`
tokens of context. Prefill chunks and decodes mix freely; padding tokens sit after
`query_start[-1]` and write their K/V into a scratch slot that no sequence reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import jax
import numpy as np


class MetadataPart(Protocol):
    """A cache feature's part of the attention metadata (a pytree)."""

    def for_layer(self, layer: int | jax.Array, pages: tuple[int, ...]) -> MetadataPart:
        """The part layer `layer` reads, addressing the pool of every layer seen flat (as
        `AttentionMetadata.for_layer`)."""
        ...


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
    # Cache features' own parts, by feature name, read by their wrappers of the backend
    # (Apt-Serve's hidden cache, `jserve.cache_features.hidden_cache.metadata`; LayerKV's
    # per-layer tables, `...layer_offload.metadata`); each a `MetadataPart`. Empty: plain
    # paged KV, which every backend attends over itself.
    parts: dict[str, MetadataPart] = field(default_factory=dict)

    def for_layer(self, layer: int | jax.Array, pages: tuple[int, ...]) -> AttentionMetadata:
        """The metadata layer `layer` attends and writes through, addressing the pool of
        every layer seen flat, in which the layer's block `b` is `layer * pages[0] + b`
        (`jserve.models.paged.KVCache`; `pages`: one layer's pool shape `[blocks,
        block_size, kv_heads, head_dim]`)."""
        first = layer * pages[0]
        parts = {name: part.for_layer(layer, pages) for name, part in self.parts.items()}
        return dataclasses.replace(self, block_tables=self.block_tables + first,
                                   slot_mapping=self.slot_mapping + first * pages[1], parts=parts)


def ragged_metadata(
    starts: np.ndarray,
    query_lens: np.ndarray,
    tables: Sequence[np.ndarray] | np.ndarray,
    *,
    num_tokens: int,
    num_seqs: int,
    max_blocks: int,
    block_size: int,
    scratch_block: int,
    decode_only: bool = False,
) -> AttentionMetadata:
    """Host-side (numpy) metadata of a step padded to `num_tokens` x `num_seqs`.

    Sequence `i` computes `query_lens[i]` tokens from position `starts[i]` through the
    physical blocks `tables[i]`: one array per sequence, or rows of a `[n, >= max_blocks]`
    array already padded with the scratch block (a runner's persistent tables). Padding
    tokens write to the scratch block; padded sequences are empty and their tables point at
    the scratch block.
    """
    n = len(query_lens)
    t_real = int(np.sum(query_lens))
    block_tables = np.full((num_seqs, max_blocks), scratch_block, np.int32)
    if isinstance(tables, np.ndarray) and tables.ndim == 2:
        block_tables[:n] = tables[:, :max_blocks]
    else:
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
    seq_of_token = np.repeat(np.arange(n), query_lens)
    query_start = np.zeros(num_seqs + 1, np.int32)
    query_start[1 : n + 1] = np.cumsum(query_lens)
    query_start[n + 1 :] = t_real
    positions = np.zeros(num_tokens, np.int32)
    pos = np.asarray(starts)[seq_of_token] + np.arange(t_real) - query_start[seq_of_token]
    positions[:t_real] = pos
    slots = np.full(num_tokens, scratch_block * block_size, np.int32)
    slots[:t_real] = block_tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    context_lens = np.zeros(num_seqs, np.int32)
    context_lens[:n] = np.asarray(starts) + np.asarray(query_lens)
    return AttentionMetadata(positions, slots, query_start, context_lens, block_tables, decode_only)

