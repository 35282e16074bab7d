"""What must hold between any two engine steps, whatever the policy: the property tests
check it after every step of random traces, so a bookkeeping bug shows at the step that
made it rather than as a leak or a wrong output much later."""

from __future__ import annotations

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.prefix import PrefixIndex
from jserve.cache_features.protocol import CacheFeature
from jserve.cache_features.registry import block_tokens
from jserve.engine.fork import Forks
from jserve.engine.live_requests import LiveRequests
from jserve.engine.request import SWAPPED, WAITING


_ROW_COLUMNS = ("seq_id", "status", "num_blocks", "num_host_blocks",
                "num_computed", "num_tokens", "max_len")


def check_invariants(live: LiveRequests, blocks: BlockManager, host_blocks: BlockManager | None,
                     prefix: PrefixIndex | None, features: tuple[CacheFeature, ...] = (),
                     forks: Forks | None = None) -> None:
    blocks.check_invariants()
    if forks is not None:
        forks.check_invariants(prefix is not None)
    live_seqs = set(live.requests)
    for feature in features:
        feature.check_invariants(prefix is not None)
    if host_blocks is not None:
        host_blocks.check_invariants()
        assert host_blocks.seq_ids() <= live_seqs, "host blocks of a request that ended"
    cols = live.cols
    rows = live.live_rows()  # in the order of live.items()
    assert len(live.table) == len(live.requests) == len(rows)
    # Each live row's columns as Python ints, read once: numpy scalars cost this check (run
    # after every step of the property tests) most of its time.
    tokens = np.broadcast_to(block_tokens(features, blocks.block_size, rows), rows.shape)
    per_row = zip(live.items(), tokens.tolist(), *(getattr(cols, name)[rows].tolist() for name in _ROW_COLUMNS))
    owned = {s for feature in features for s in feature.own_blocks()}  # checked by their feature
    for (seq_id, _), bs, row_seq, status, num_blocks, num_host_blocks, \
            num_computed, num_tokens, max_len in per_row:
        assert row_seq == seq_id
        if owned and seq_id in owned:
            continue
        assert num_blocks == blocks.num_held(seq_id), f"seq {seq_id} blocks"
        assert 0 <= num_computed <= num_tokens <= max_len
        assert status == WAITING or num_computed <= (num_blocks + num_host_blocks) * bs
        assert num_tokens == live.requests[seq_id].num_tokens
        host = 0 if host_blocks is None else host_blocks.num_held(seq_id)
        assert num_host_blocks == host, f"seq {seq_id} host blocks"
        if status == WAITING:
            # num_computed: the cached prefix it starts from (0 without a prefix cache)
            assert num_blocks == 0 and host == 0
            assert num_computed % bs == 0
            assert prefix is not None or num_computed == 0
        elif status == SWAPPED:
            assert num_blocks == 0, f"swapped seq {seq_id} holds device blocks"
            assert num_computed <= host * bs
        else:
            assert host == 0, f"running seq {seq_id} holds host blocks"
    assert blocks.seq_ids() <= live_seqs, "blocks held by a request that ended"
    assert live.awaiting_run | live.token_checked <= live_seqs, "an ended request still tracked"
    assert (cols.reserved_blocks[rows] >= 0).all()
    assert int(cols.reserved_blocks[rows].sum()) <= blocks.num_blocks, "over-reserved"
