"""The immutable snapshot a policy decides from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from jserve.engine.request_table import RequestArrays

Tokens = TypeVar("Tokens", int, np.ndarray)


@dataclass(frozen=True)
class SchedulerLimits:
    """Engine-wide bounds every plan must respect (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    @classmethod
    def with_default_budget(cls, max_num_seqs: int, max_num_batched_tokens: int | None,
                            max_model_len: int) -> SchedulerLimits:
        """vLLM's default token budget when none is given: a whole prompt fits in one step
        (no chunking needed) and every running sequence can decode together."""
        budget = max_num_batched_tokens or max(max_model_len, 2048, max_num_seqs)
        return cls(max_num_seqs, budget, max_model_len)


@dataclass(frozen=True)
class SchedulerView:
    """Everything a policy may read: arrived, unfinished requests and cache occupancy."""

    now: float
    requests: RequestArrays
    block_size: int
    num_blocks: int
    num_free_blocks: int
    limits: SchedulerLimits
    num_host_blocks: int = 0  # host tier for swap preemption; 0: recompute only
    num_free_host_blocks: int = 0
    arrival_rate: float = 0.0  # requests/s arrived over the recent window
    iteration_time: float = 0.0  # longest recent step, seconds (0 before the first step)
    # Each cache feature's part of the view, by its name (`jserve.cache_features`): a
    # policy reads one through that feature's `section` module.
    features: Mapping[str, object] = field(default_factory=dict)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to live requests beyond what they hold (reserved, not yet
        materialised): free blocks that reserving policies must not hand to others."""
        r = self.requests
        return int((r.reserved_blocks - r.num_blocks).clip(min=0).sum())

    def blocks_for(self, num_tokens: Tokens) -> Tokens:
        """Blocks that hold `num_tokens` tokens (of one request, or of each of many)."""
        return -(-num_tokens // self.block_size)
