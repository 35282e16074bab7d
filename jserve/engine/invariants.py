"""What must hold between any two engine steps, whatever the policy: the property tests
check it after every step of random traces, so a bookkeeping bug shows at the step that
made it rather than as a leak or a wrong output much later."""

from __future__ import annotations

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.layers import kept_layers
from jserve.cache.prefix import PrefixIndex
from jserve.engine.layer_residency import LayerResidency
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import CacheType
from jserve.engine.request import OFFLOADED, SWAPPED, WAITING


def check_invariants(live: LiveRequests, blocks: BlockManager, host_blocks: BlockManager | None,
                     prefix: PrefixIndex | None, residency: LayerResidency,
                     hidden_block_tokens: int = 0) -> None:
    blocks.check_invariants()
    live_seqs = set(live.requests)
    residency.check_invariants(live_seqs)
    num_layers = residency.num_layers
    if host_blocks is not None:
        host_blocks.check_invariants()
        assert host_blocks.seq_ids() <= live_seqs, "host blocks of a request that ended"
    cols = live.cols
    assert len(live.table) == len(live.requests) == len(live.live_rows())
    for seq_id, row in live.items():
        assert cols.seq_id[row] == seq_id
        part = residency.partial.get(seq_id)
        hidden = cols.cache_type[row] == CacheType.HIDDEN  # rows, not K/V
        assert cols.cache_type[row] in tuple(CacheType), f"seq {seq_id} cache type {cols.cache_type[row]}"
        if hidden:
            assert hidden_block_tokens > 0, f"hidden seq {seq_id} on a model without a hidden cache"
            assert part is None and prefix is None, f"hidden seq {seq_id} offloaded or prefix-shared"
            assert cols.status[row] != SWAPPED and cols.num_host_blocks[row] == 0, \
                f"hidden seq {seq_id} swapped"
        bs = hidden_block_tokens if hidden else blocks.block_size
        assert (part is None) == (cols.device_layers[row] == num_layers), f"seq {seq_id} layers"
        if part is not None:  # prefilled, some layers' KV on the host
            assert cols.status[row] == OFFLOADED, f"partly offloaded seq {seq_id} is {cols.status[row]}"
            assert part.kept == kept_layers(num_layers, int(cols.device_layers[row]))
            assert cols.num_blocks[row] == part.num_blocks, f"seq {seq_id} layer blocks"
            # 0 between the plan that prefills it keeping some layers and that step's commit
            assert 0 <= cols.num_computed[row] <= part.num_blocks * bs
            assert cols.num_host_blocks[row] == 0 and host_blocks.num_held(seq_id) == 0
            continue
        assert cols.status[row] != OFFLOADED, f"seq {seq_id} offloaded with every layer on the device"
        assert cols.num_blocks[row] == blocks.num_held(seq_id), f"seq {seq_id} blocks"
        assert 0 <= cols.num_computed[row] <= cols.num_tokens[row] <= cols.max_len[row]
        held = cols.num_blocks[row] + cols.num_host_blocks[row]
        assert cols.status[row] == WAITING or cols.num_computed[row] <= held * bs
        assert cols.num_tokens[row] == live.requests[seq_id].num_tokens
        host = 0 if host_blocks is None else host_blocks.num_held(seq_id)
        assert cols.num_host_blocks[row] == host, f"seq {seq_id} host blocks"
        if cols.status[row] == WAITING:
            # num_computed: the cached prefix it starts from (0 without a prefix cache)
            assert cols.num_blocks[row] == 0 and host == 0
            assert cols.num_computed[row] % bs == 0
            assert prefix is not None or cols.num_computed[row] == 0
        elif cols.status[row] == SWAPPED:
            assert cols.num_blocks[row] == 0, f"swapped seq {seq_id} holds device blocks"
            assert cols.num_computed[row] <= host * bs
        else:
            assert host == 0, f"running seq {seq_id} holds host blocks"
    assert blocks.seq_ids() <= live_seqs, "blocks held by a request that ended"
    assert live.awaiting_run | live.token_checked <= live_seqs, "an ended request still tracked"
    rows = live.live_rows()
    assert (cols.reserved_blocks[rows] >= 0).all()
    assert int(cols.reserved_blocks[rows].sum()) <= blocks.num_blocks, "over-reserved"
