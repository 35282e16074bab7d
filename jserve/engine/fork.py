"""Several sequences of one prompt (`SamplingParams.n` / `best_of`).

The request is admitted as one sequence and its prompt prefilled once; the step that
samples its first token forks the other sequences from it. A child shares the parent's
full blocks by reference count and gets its own copy of the block that holds the prompt's
last token (copy-on-write, done once at fork time: the runner copies the block before the
next step's compute, `Batch.block_copies`). The child leaves that last prompt token to
compute, so the next step runs it as a one-token decode and the child samples its first
token from those logits with its own seed: every sequence draws its first token on its
own, and greedy sequences equal separate requests.

A child that cannot have its copy enters waiting, holding nothing, and prefills the prompt
itself when a policy admits it: when `max_num_seqs` requests already run (policies admit
within it, and decode every running request), when no free block is left that no
reservation has promised, or on an engine whose cache features cannot hold shared blocks
(`share=False`).

To policies a child is an ordinary request: running with one token to compute (or
waiting). Preempting or ending any sequence frees only its own references.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache_features.protocol import CacheFeature
from jserve.cache_features.registry import held
from jserve.engine.live_requests import LiveRequests
from jserve.engine.request import OFFLOADED, RUNNING, WAITING, Request, RequestMetrics
from jserve.engine.request_table import RequestArrays
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.stopping import watches_tokens
from jserve.errors import InvalidRequestError
from jserve.models.tokenizer import IncrementalDetokenizer

_COLUMNS = tuple(f.name for f in dataclasses.fields(RequestArrays) if f.name != "seq_id")


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id of sequence `index` (> 0) of a request."""
    return f"{request_id}#{index}"


def child_request_ids(request_id: str, params: SamplingParams) -> tuple[str, ...]:
    """The ids of the sequences a request forks (all but its first), in index order."""
    return tuple(child_request_id(request_id, i) for i in range(1, params.num_sequences))


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """A child's own settings: one sequence, no prompt log-probabilities (the parent has
    them), and a user's seed made its own as vLLM does (`seed + index`); without one, the
    engine's per-sequence seed differs by itself."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, prompt_logprobs=None)


@dataclass
class Forks:
    live: LiveRequests
    blocks: BlockManager
    eos_token_id: int | None
    detokenizer: Callable[[SamplingParams], IncrementalDetokenizer | None]
    max_num_seqs: int  # a child shares only while no more than this many requests run
    features: tuple[CacheFeature, ...] = ()  # a child shares only blocks none of them holds
    share: bool = True  # False: every child prefills the prompt itself
    # Parents whose first token is not sampled yet (by seq id), and their children's ids,
    # which no other request may take meanwhile.
    _pending: dict[int, tuple[str, ...]] = field(default_factory=dict, init=False)
    _reserved: set[str] = field(default_factory=set, init=False)
    _copies: list[tuple[int, int]] = field(default_factory=list, init=False)
    # Whether a request forked since the last batch was built: new sequences the caller of
    # a repeated step (`Plan.repeat`) does not know of, which end the repeat.
    forked: bool = field(default=False, init=False)

    def check_ids(self, request_id: str, params: SamplingParams) -> None:
        """Refuse a request whose id, or one of its children's, is in use or promised."""
        for rid in (request_id, *child_request_ids(request_id, params)):
            if rid in self._reserved or self.live.by_request_id(rid) is not None:
                raise InvalidRequestError(f"request id {rid!r} is already in use")

    def expect(self, req: Request) -> None:
        """An admitted request: fork it at its first token if it asks for several sequences."""
        if req.params.num_sequences > 1:
            ids = child_request_ids(req.request_id, req.params)
            self._pending[req.seq_id] = ids
            self._reserved.update(ids)

    def forget(self, req: Request) -> None:
        """A request that ended before its first token: it forks nothing."""
        self._reserved.difference_update(self._pending.pop(req.seq_id, ()))

    def fork(self, sampled: list[Request]) -> None:
        """Fork the pending parents among the requests that just sampled a token (called
        before any of them is released, while they hold their blocks)."""
        if not self._pending:
            return
        for parent in sampled:
            ids = self._pending.pop(parent.seq_id, None)
            if ids is not None:
                self.forked = True
                self._reserved.difference_update(ids)
                for index, rid in enumerate(ids, 1):
                    self._fork(parent, rid, index)

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The block copies the forks since the last call need, for the next batch."""
        copies, self._copies, self.forked = tuple(self._copies), [], False
        return copies

    def _fork(self, parent: Request, request_id: str, index: int) -> None:
        params = child_params(parent.params, index)
        child = Request(
            request_id=request_id, seq_id=self.live.new_seq_id(), prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, params=params, max_len=parent.max_len,
            metrics=RequestMetrics(parent.metrics.arrival_time,
                                   first_scheduled_time=parent.metrics.first_scheduled_time),
            detokenizer=self.detokenizer(params), conversation_id=parent.conversation_id,
            index=index, parent_seq_id=parent.seq_id, parent_request_id=parent.request_id,
        )
        cols, row = self.live.cols, self.live.row(parent.seq_id)
        columns = {name: getattr(cols, name)[row] for name in _COLUMNS}
        columns.update(num_tokens=len(parent.prompt_token_ids), num_preemptions=0, num_host_blocks=0,
                       first_token_time=math.nan, last_token_time=math.nan,
                       status=WAITING, num_computed=0, num_blocks=0)
        promised = columns["reserved_blocks"]  # the parent's: set below if the child shares
        columns["reserved_blocks"] = 0
        shared = self._shareable(parent, row)
        if shared is not None:
            self.blocks.share(parent.seq_id, child.seq_id, shared)
            self.blocks.allocate(child.seq_id, 1)
            self._copies.append((self.blocks.table(parent.seq_id)[shared], self.blocks.table(child.seq_id)[-1]))
            # Under a reserving policy the child is promised what it holds (`_shareable`).
            columns.update(status=RUNNING, num_computed=len(parent.prompt_token_ids) - 1,
                           num_blocks=shared + 1, reserved_blocks=shared + 1 if promised else 0)
        self.live.add(child, watches_tokens(child, self.eos_token_id), **columns)

    def _shareable(self, parent: Request, row: int) -> int | None:
        """How many of the parent's blocks a child shares (those before the one holding the
        prompt's last token), or None when it cannot share: sharing is off, the parent's
        blocks are not plain whole KV blocks on the device, or no unpromised block is free
        for the copy, or `max_num_seqs` requests run already. Under a reserving policy (the parent holds a reservation) the child
        is promised the blocks it holds, which must fit the cache's reservations."""
        cols = self.live.cols
        shared = (len(parent.prompt_token_ids) - 1) // self.blocks.block_size
        if (not self.share or cols.status[row] != RUNNING or held(self.features, [parent.seq_id])[0]
                or self.blocks.num_held(parent.seq_id) <= shared):
            return None
        live = self.live.table.live_mask
        if int(np.isin(cols.status[live], (RUNNING, OFFLOADED)).sum()) >= self.max_num_seqs:
            return None
        reserved = cols.reserved_blocks[live]
        if cols.reserved_blocks[row] and int(reserved.sum()) + shared + 1 > self.blocks.num_blocks:
            return None  # a reserving policy's child is promised its blocks: no room to
        promised = int(np.maximum(reserved - cols.num_blocks[live], 0).sum())
        return shared if self.blocks.num_free - promised >= 1 else None

    def check_invariants(self, prefix_cache: bool) -> None:
        """Pending parents are live and have read no token; promised ids are no live
        request's; without a prefix cache, only sequences of one request share a block."""
        for seq_id, ids in self._pending.items():
            req = self.live.requests.get(seq_id)
            assert req is not None and not req.output_token_ids, f"seq {seq_id}: a stale pending fork"
            assert self._reserved.issuperset(ids)
        assert all(self.live.by_request_id(rid) is None for rid in self._reserved), "a promised id is live"
        if prefix_cache:
            return
        owner: dict[int, str] = {}
        for seq_id in self.blocks.seq_ids():
            group = self.live.requests[seq_id].group_request_id
            for block in self.blocks.table(seq_id):
                assert owner.setdefault(block, group) == group, f"block {block} shared across requests"
