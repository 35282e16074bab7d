"""Layer residency's runner side: a partly offloaded sequence computes its offloaded layers'
K/V in staging blocks after the engine's own (its host layers streamed in before the step,
its new K/V written back after), and each layer has a table of its own for the step; the
plan's residency changes are per-layer copies between the host pool and the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jserve.cache_features.layer_offload.batch import LayerMove, layer_work
from jserve.cache_features.layer_offload.host_pool import LayerHostPool
from jserve.cache_features.layer_offload.metadata import LayerTablesAttention, with_layer_tables
from jserve.cache_features.layer_offload.section import NAME
from jserve.cache_features.protocol import StepContext, StepFeature
from jserve.engine.batch import Batch
from jserve.models.paged import KVCache
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.backends import AttentionBackend

Staging = dict[int, np.ndarray]  # staging blocks of each partly offloaded sequence, by batch index
Reads = list[tuple[str, int, np.ndarray, tuple]]  # (where to, layer, destination blocks, (K, V))


def _by_layer(moves: Sequence[LayerMove]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Moves' source and destination blocks, concatenated per layer."""
    grouped: dict[int, list[LayerMove]] = {}
    for m in moves:
        grouped.setdefault(m.layer, []).append(m)
    return {layer: (np.concatenate([m.src for m in ms]), np.concatenate([m.dst for m in ms]))
            for layer, ms in grouped.items()}


class LayerSteps(StepFeature):
    """Staging room for a step's partly offloaded sequences (its prefills fill at most
    `max_tokens / block_size` blocks plus one partial block each) and the host pool of
    `num_host_blocks` blocks per layer."""

    name = NAME

    def __init__(self, ctx: StepContext, num_host_blocks: int) -> None:
        self.ctx = ctx
        self.num_host_blocks = num_host_blocks
        self.staging_start = ctx.num_blocks
        self.pool: LayerHostPool | None = None

    @classmethod
    def build(cls, ctx: StepContext, *, layer_staging: bool = False, num_host_blocks: int = 0,
              **_: object) -> LayerSteps | None:
        """`layer_staging`: the policy offloads layers; without a host tier none can be."""
        return cls(ctx, num_host_blocks) if layer_staging and num_host_blocks else None

    def extra_blocks(self) -> int:
        return -(-self.ctx.max_tokens // self.ctx.block_size) + self.ctx.max_seqs

    def bind(self, scratch_block: int) -> None:
        c = self.ctx
        self.scratch_block = scratch_block
        self.pool = LayerHostPool(
            c.attention.gather_blocks, c.attention.scatter_blocks,
            (self.num_host_blocks, c.block_size, c.cfg.num_kv_heads, c.cfg.head_dim), c.kv_dtype,
            c.cfg.num_layers, scratch_block, c.pages_sharding)

    def warm_up(self, cache: KVCache) -> KVCache:
        return self.pool.warm_up(cache)

    def wrap_attention(self, attention: AttentionBackend) -> LayerTablesAttention:
        return LayerTablesAttention(attention)

    # ------------------------------------------------------------------ residency changes
    def before_moves(self, batch: Batch, cache: KVCache) -> Reads:
        """The residency changes' sources: one host read or device gather per layer and
        kind."""
        pool, own = self.pool, layer_work(batch)
        return ([("device", layer, dst, pool.read(layer, src))
                 for layer, (src, dst) in _by_layer(own.to_device).items()]
                + [("host", layer, dst, pool.gather(cache, layer, src))
                   for layer, (src, dst) in _by_layer(own.to_host).items()]
                + [("device", layer, dst, pool.gather(cache, layer, src))
                   for layer, (src, dst) in _by_layer(own.copies).items()])

    def after_moves(self, reads: Reads, cache: KVCache) -> KVCache:
        for kind, layer, dst, (k, v) in reads:
            if kind == "host":
                self.pool.write_from_device(layer, dst, k, v)
            else:
                cache = self.pool.scatter(cache, layer, dst, k, v)
        return cache

    # ------------------------------------------------------------------ staging
    def _staging_need(self, batch: Batch) -> dict[int, int]:
        """Staging blocks each partly offloaded sequence needs, by batch index: its context
        after the step (each offloaded layer's in that layer's own staging rows)."""
        end = batch.start + batch.query_lens
        return {i: -(-int(end[i]) // self.ctx.block_size) for i in layer_work(batch).tables}

    def groups(self, batch: Batch) -> list[np.ndarray] | None:
        """Consecutive groups whose partly offloaded sequences' context fits the staging
        rows: one unless decodes with layers on the host need more (the tokens are the
        same)."""
        if not layer_work(batch).tables:
            return None
        room = self.scratch_block - self.staging_start
        need = self._staging_need(batch)
        groups, first, used = [], 0, 0
        for i in range(batch.num_seqs):
            k = need.get(i, 0)
            if k > room:
                raise RuntimeError(f"seq {batch.seq_ids[i]} needs {k} staging blocks, {room} exist")
            if used + k > room:
                groups.append(np.arange(first, i))
                first, used = i, 0
            used += k
        return groups + [np.arange(first, batch.num_seqs)]

    def before_compute(self, batch: Batch, cache: KVCache) -> tuple[KVCache, Staging]:
        """Staging blocks for each partly offloaded sequence, and the offloaded layers'
        context of those past their first token (decodes) streamed in, host -> staging:
        one host read and one scatter per layer."""
        staging, nxt = {}, self.staging_start
        for i, n in self._staging_need(batch).items():
            staging[i] = np.arange(nxt, nxt + n, dtype=np.int32)
            nxt += n
        for layer, (src, dst) in _by_layer(self._host_moves(batch, staging, True)).items():
            cache = self.pool.scatter(cache, layer, dst, *self.pool.read(layer, src))
        return cache, staging

    def metadata(self, batch: Batch, meta: AttentionMetadata,
                 table_of: Callable[[int], np.ndarray], step: Staging) -> AttentionMetadata:
        tables = layer_work(batch).tables
        if not tables:
            return meta
        per_layer = {i: [d if len(d) else step[i] for d in t.device] for i, t in tables.items()}
        return with_layer_tables(meta, per_layer, len(next(iter(per_layer.values()))),
                                 self.ctx.block_size)

    def padding_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return with_layer_tables(meta, {}, self.ctx.cfg.num_layers, self.ctx.block_size)

    def after_compute(self, batch: Batch, cache: KVCache, step: Staging) -> None:
        """The offloaded layers' K/V this step computed, staging -> host pool: one gather and
        one host write per layer."""
        for layer, (src, dst) in _by_layer(self._host_moves(batch, step, False)).items():
            self.pool.write_from_device(layer, dst, *self.pool.gather(cache, layer, src))

    def _host_moves(self, batch: Batch, staging: Staging, before: bool) -> list[LayerMove]:
        """Per offloaded layer of each partly offloaded sequence, host blocks <-> its
        staging blocks: `before` the step, those holding its context (host -> staging);
        after it, those its new tokens fill (staging -> host)."""
        bs, moves = self.ctx.block_size, []
        for i, tables in layer_work(batch).tables.items():
            start = int(batch.start[i])
            lo, hi = (0, -(-start // bs)) if before else (start // bs, len(staging[i]))
            for layer, host in enumerate(tables.host):
                if len(host) and hi > lo:
                    src, dst = (host, staging[i]) if before else (staging[i], host)
                    moves.append(LayerMove(-1, layer, src[lo:hi], dst[lo:hi]))
        return moves
