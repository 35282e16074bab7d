"""Layer residency's part of a step's attention metadata (`AttentionMetadata.parts`): a
table and write slots per layer, since a partly offloaded sequence keeps each layer in
blocks of its own; and the attention that swaps them in for the backend, which knows one
table per sequence."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jserve.cache_features.layer_offload.section import NAME
from jserve.cache_features.protocol import AttentionWrapper
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.hidden_attention import KVProjection


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerMetadata:
    """Every layer's block tables and write slots, `[L, S, max_blocks]` and `[L, T]`; a
    sequence whose layers all share its blocks has its base table in every layer."""

    block_tables: jax.Array
    slot_mapping: jax.Array

    def for_layer(self, layer: int | jax.Array, pages: tuple[int, ...]) -> LayerMetadata:
        """Layer `layer`'s table and slots `[S, max_blocks]`, `[T]`, in the pool of every
        layer seen flat (layer `l`'s block `b` is `l * pages[0] + b`)."""
        first = layer * pages[0]
        return LayerMetadata(self.block_tables[layer] + first, self.slot_mapping[layer] + first * pages[1])


def with_layer_tables(meta: AttentionMetadata, layer_tables: dict[int, Sequence[np.ndarray]],
                      num_layers: int, block_size: int) -> AttentionMetadata:
    """`meta` (host-side) with its part under the feature's name: sequence `i` in
    `layer_tables` reads and writes layer `l` through `layer_tables[i][l]`, the others
    through `meta.block_tables`."""
    tables = np.repeat(np.asarray(meta.block_tables)[None], num_layers, axis=0)
    for i, per_layer in layer_tables.items():
        for layer, table in enumerate(per_layer):
            tables[layer, i, : len(table)] = table
    slots = np.repeat(np.asarray(meta.slot_mapping)[None], num_layers, axis=0)
    query_start = np.asarray(meta.query_start)
    positions = np.asarray(meta.positions)
    for i in layer_tables:
        tok = np.arange(query_start[i], query_start[i + 1])
        pos = positions[tok]
        slots[:, tok] = tables[:, i, pos // block_size] * block_size + pos % block_size
    return dataclasses.replace(meta, parts={**meta.parts, NAME: LayerMetadata(tables, slots)})


class LayerTablesAttention(AttentionWrapper):
    """`inner`, through this layer's own tables and slots where the metadata has the
    feature's part (already narrowed to the layer by `AttentionMetadata.for_layer`)."""

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: KVProjection | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        own: LayerMetadata | None = meta.parts.get(NAME)
        if own is not None:
            meta = dataclasses.replace(meta, block_tables=own.block_tables, slot_mapping=own.slot_mapping,
                                       parts={n: p for n, p in meta.parts.items() if n != NAME})
        return self.inner(q, k, v, k_pages, v_pages, meta, scale=scale, hidden=hidden, proj=proj)
