"""The hidden cache's part of a step's attention metadata (`AttentionMetadata.parts`), built
on the host: which tokens are its sequences', where each token's row goes in the K or V
page of its block, and the tables and contexts its attention reads."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jserve.cache_features.hidden_cache.section import NAME
from jserve.pallas_kernels.attention_metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HiddenMetadata:
    """A step's sequences on Apt-Serve's hidden cache (`with_hidden`): each layer writes
    their tokens' attention input rows into their blocks, K page then V page, and they
    attend through K/V projected from those rows. Their K/V writes (`slot_mapping`) go to
    the scratch block, and the KV path sees them with no cached prefix."""

    token_mask: jax.Array  # [T] bool: tokens of hidden sequences
    k_offsets: jax.Array  # [T] int32: flat element of the K pool where the token's row starts
    v_offsets: jax.Array  # [T] int32: the same in the V pool (the other one: the scratch block)
    block_tables: jax.Array  # [S, max_hidden_blocks]: hidden sequences' blocks, others scratch
    context_lens: jax.Array  # [S]: hidden sequences' contexts; others their query length

    def for_layer(self, layer: int | jax.Array, pages: tuple[int, ...]) -> HiddenMetadata:
        """Its blocks and row offsets in the pool of every layer seen flat (layer `l`'s block
        `b` is `l * pages[0] + b`)."""
        first = layer * pages[0]
        page_size = math.prod(pages[1:])
        return dataclasses.replace(self, block_tables=self.block_tables + first,
                                   k_offsets=self.k_offsets + first * page_size,
                                   v_offsets=self.v_offsets + first * page_size)


def with_hidden(meta: AttentionMetadata, hidden: np.ndarray, tables: Sequence[np.ndarray], *,
                rows_per_page: int, row_size: int, page_size: int, max_blocks: int,
                scratch_block: int, block_size: int) -> AttentionMetadata:
    """`meta` (host-side, built with empty tables for the hidden sequences) with sequences
    `hidden` (`[n]` bool) on the hidden cache, its part under the feature's name: token at position `p` of such a sequence keeps
    its row in logical block `p // (2 * rows_per_page)` of `tables[i]`, in the block's K page
    for the first `rows_per_page` positions of the block and its V page for the rest, rows of
    `row_size` values in pages of `page_size` values."""
    query_start = np.asarray(meta.query_start)
    positions = np.asarray(meta.positions)
    n, num_seqs, num_tokens = len(hidden), len(meta.context_lens), len(positions)
    query_lens = (query_start[1:] - query_start[:-1]).astype(np.int32)
    is_hidden = np.zeros(num_seqs, bool)
    is_hidden[:n] = hidden
    context = np.asarray(meta.context_lens)
    hidden_context = np.where(is_hidden, context, query_lens).astype(np.int32)
    kv_context = np.where(is_hidden, query_lens, context).astype(np.int32)
    block_tables = np.full((num_seqs, max_blocks), scratch_block, np.int32)
    for i in np.flatnonzero(hidden):
        block_tables[i, : len(tables[i])] = tables[i]
    t_real = int(query_start[n])
    seq_of_token = np.repeat(np.arange(n), query_lens[:n])
    mask = np.zeros(num_tokens, bool)
    mask[:t_real] = hidden[seq_of_token]
    tok = np.flatnonzero(mask)
    pos = positions[tok]
    within = pos % (2 * rows_per_page)
    start = (block_tables[seq_of_token[tok], pos // (2 * rows_per_page)] * page_size
             + within % rows_per_page * row_size)
    in_v = within >= rows_per_page
    k_offsets = np.full(num_tokens, scratch_block * page_size, np.int32)
    v_offsets = k_offsets.copy()
    k_offsets[tok[~in_v]] = start[~in_v]
    v_offsets[tok[in_v]] = start[in_v]
    slots = np.asarray(meta.slot_mapping).copy()
    slots[tok] = scratch_block * block_size
    part = HiddenMetadata(mask, k_offsets, v_offsets, block_tables, hidden_context)
    return dataclasses.replace(meta, slot_mapping=slots, context_lens=kv_context,
                               parts={**meta.parts, NAME: part})
