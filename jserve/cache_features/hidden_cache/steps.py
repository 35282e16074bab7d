"""The hidden cache's runner side: where a hidden-cache sequence's rows go in the KV pool,
its part of the step's metadata, and the attention that wraps the backend's (the backend
attends over paged KV only; this writes hidden rows and attends over them for those
sequences)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.sizing import hidden_rows_per_page
from jserve.cache_features.hidden_cache.batch import hidden_mask
from jserve.cache_features.hidden_cache.metadata import HiddenMetadata, with_hidden
from jserve.cache_features.hidden_cache.section import NAME
from jserve.cache_features.protocol import AttentionWrapper, StepContext, StepFeature
from jserve.engine.batch import Batch
from jserve.errors import ConfigError
from jserve.models.config import ModelConfig
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.backends import AttentionBackend
from jserve.pallas_kernels.hidden_attention import HiddenPool, KVProjection, write_hidden_rows


@dataclass(frozen=True)
class HiddenLayout:
    """Where a hidden-cache sequence's rows go in the KV pool (Apt-Serve, Section 4.3):
    `rows_per_page` rows of `row_size` (the model's hidden size) values at the start of a
    block's K page, then as many in its V page, pages of `page_size` values; tables up to
    `max_blocks` wide."""

    rows_per_page: int
    row_size: int
    page_size: int
    max_blocks: int

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, max_model_len: int) -> HiddenLayout | None:
        """None when a page cannot hold one row."""
        rows = hidden_rows_per_page(cfg, block_size)
        if rows < 1:
            return None
        return cls(rows, cfg.hidden_size, block_size * cfg.num_kv_heads * cfg.head_dim,
                   -(-max_model_len // (2 * rows)))


class HiddenCacheAttention(AttentionWrapper):
    """`inner` for every sequence but those the metadata's part puts on the hidden cache: their
    layer input rows go into their blocks (K page, then V page) and they attend through K/V
    projected from those rows, with `inner`'s hidden-row kernel."""

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: KVProjection | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        h: HiddenMetadata | None = meta.parts.get(NAME)
        if h is None:
            return self.inner(q, k, v, k_pages, v_pages, meta, scale=scale)
        k_pages, v_pages = self.inner.write_kv(k_pages, v_pages, k, v, meta.slot_mapping)
        pool = write_hidden_rows(HiddenPool.in_kv_pages(k_pages, v_pages, hidden.shape[-1]),
                                 hidden, (h.k_offsets, h.v_offsets))
        k_pages, v_pages = pool.pages
        out = self.inner.attend(q, k_pages, v_pages, meta, scale=scale)
        rows = dataclasses.replace(meta, block_tables=h.block_tables, context_lens=h.context_lens,
                                   decode_only=False, parts={})
        out_hidden = self.inner.hidden(q, pool, proj, rows, scale=scale)
        return jnp.where(h.token_mask[:, None, None], out_hidden, out), k_pages, v_pages


class HiddenSteps(StepFeature):
    """Steps where some sequences are on the hidden cache: their tables are wider (a block
    holds `2 * rows_per_page` tokens' rows) and the attention is wrapped."""

    name = NAME

    def __init__(self, ctx: StepContext, layout: HiddenLayout, compiled_ahead: bool) -> None:
        self.ctx = ctx
        self.layout = layout
        self.compiled_ahead = compiled_ahead

    @classmethod
    def build(cls, ctx: StepContext, *, hidden_steps: bool = False, **_: object) -> HiddenSteps | None:
        """Any model whose pages hold a whole row can run hidden-cache steps; `hidden_steps`
        (the policy uses the hidden cache where it saves memory) has warm-up compile them
        and the tables sized for them."""
        layout = HiddenLayout.of(ctx.cfg, ctx.block_size, ctx.max_model_len)
        return None if layout is None else cls(ctx, layout, hidden_steps)

    def table_width(self) -> int:
        return self.layout.max_blocks if self.compiled_ahead else 0

    def bind(self, scratch_block: int) -> None:
        """Its rows are addressed by int32 element offsets into the K (or V) pool of every
        layer seen flat, so a policy on the hidden cache cannot use a pool past 2**31 values."""
        values = self.ctx.cfg.num_layers * (scratch_block + 1) * self.layout.page_size
        if self.compiled_ahead and values >= 2**31:
            raise ConfigError(f"the hidden cache addresses at most 2**31 values of the K pool; "
                              f"this one holds {values:,} (fewer blocks would do)")
        self.scratch_block = scratch_block

    def wrap_attention(self, attention: AttentionBackend) -> HiddenCacheAttention:
        return HiddenCacheAttention(attention)

    def tables(self, batch: Batch, tables: np.ndarray) -> np.ndarray:
        """Its sequences attend to no paged K/V but their own step's."""
        hidden = hidden_mask(batch)
        if hidden is not None:
            tables[hidden] = self.scratch_block
        return tables

    def metadata(self, batch: Batch, meta: AttentionMetadata,
                 table_of: Callable[[int], np.ndarray], step: object) -> AttentionMetadata:
        hidden = hidden_mask(batch)
        if hidden is None:
            return meta
        return self._with_hidden(meta, hidden, [table_of(i) for i in range(batch.num_seqs)])

    def padding_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self._with_hidden(meta, np.zeros(0, bool), [])

    def _with_hidden(self, meta: AttentionMetadata, hidden: np.ndarray,
                     tables: list[np.ndarray]) -> AttentionMetadata:
        h = self.layout
        return with_hidden(meta, hidden, tables, rows_per_page=h.rows_per_page, row_size=h.row_size,
                           page_size=h.page_size, max_blocks=h.max_blocks,
                           scratch_block=self.scratch_block, block_size=self.ctx.block_size)
