"""The runner's work list for an applied plan: which sequences compute which tokens, which
of them yield a token, the block copies to make first, each cache feature's part, and (for
a runner that runs a model) the token ids and what changed in the sequences it keeps
(`batch_delta`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jserve.cache_features.protocol import CacheFeature, Runs
from jserve.engine.batch import Batch, BatchInputs
from jserve.engine.batch_delta import DeltaTracker
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan_apply import Moves
from jserve.engine.plan_check import CheckedPlan
from jserve.engine.request import PLACEHOLDER, Request
from jserve.structured import bitmask_words, fill_bitmasks


@dataclass(frozen=True)
class BatchBuilder:
    live: LiveRequests
    features: tuple[CacheFeature, ...]
    deltas: DeltaTracker

    def build(self, checked: CheckedPlan, moves: Moves, host_dropped: tuple[int, ...],
              with_inputs: bool) -> Batch:
        """The plan's runs in plan order, each cache feature's part of the step; `with_inputs`
        adds what a real runner reads."""
        cols, run = self.live.cols, checked.plan.run
        seq_ids = np.fromiter(run.keys(), np.int64, len(run))
        query_lens = checked.run_lens.astype(np.int32)
        start = cols.num_computed[checked.run_rows].astype(np.int32)
        sample = (start + query_lens) == cols.num_tokens[checked.run_rows]
        if with_inputs:
            inputs = self._inputs(seq_ids, start, query_lens)
        else:
            inputs = None
            self.deltas.discard()
        runs = Runs(seq_ids, checked.run_rows, start, query_lens)
        found = ((f.name, f.batch_section(section, runs, with_inputs))
                 for f, section in zip(self.features, checked.sections))
        return Batch(seq_ids=seq_ids, start=start, query_lens=query_lens, sample=sample,
                     inputs=inputs, swap_out=moves.swap_out, swap_in=moves.swap_in,
                     host_dropped=host_dropped, features={n: s for n, s in found if s is not None})

    def _inputs(self, seq_ids: np.ndarray, start: np.ndarray, query_lens: np.ndarray) -> BatchInputs:
        reqs = [self.live.requests[s] for s in seq_ids.tolist()]
        starts, lens = start.tolist(), query_lens.tolist()
        tokens = [_slice(r, b, q) for r, b, q in zip(reqs, starts, lens)]
        next_ids = None
        if any(r.params.prompt_logprobs is not None for r in reqs):
            following = (_slice(r, b + 1, q) for r, b, q in zip(reqs, starts, lens))
            next_ids = np.concatenate([np.pad(np.asarray(f, np.int32), (0, q - len(f)))
                                       for f, q in zip(following, lens)])
        return BatchInputs(
            token_ids=np.fromiter((t for chunk in tokens for t in chunk), np.int32, int(query_lens.sum())),
            output_index=np.fromiter((len(r.output_token_ids) + r.pending_tokens for r in reqs),
                                     np.int32, len(reqs)),
            delta=self.deltas.take(seq_ids),
            logprobs=any(r.params.logprobs is not None for r in reqs) or next_ids is not None,
            next_token_ids=next_ids,
            token_mask=_token_mask(reqs) if self.live.constrained else None,
        )


def _token_mask(reqs: list[Request]) -> np.ndarray | None:
    """The batch's grammar bitmask: each constrained request's row from its matcher (at its
    last read token: the loop runs in step while one is live), the others' all ones."""
    rows = [(r.matcher, i) for i, r in enumerate(reqs) if r.matcher is not None]
    if not rows:
        return None
    mask = np.full((len(reqs), bitmask_words(rows[0][0].vocab_size)), -1, np.int32)
    fill_bitmasks(mask, rows)
    return mask


def _slice(req: Request, start: int, n: int) -> list[int]:
    """Tokens `start` to `start + n` of the request (a not yet read one is `PLACEHOLDER`),
    without joining its prompt and output: a decode reads one token of a long history."""
    prompt = req.prompt_token_ids
    if start + n <= len(prompt):
        return prompt[start : start + n]
    if start >= len(prompt):
        out = req.output_token_ids
        at = start - len(prompt)
        got = out[at : at + n]
        return got + [PLACEHOLDER] * min(n - len(got), req.pending_tokens)
    return req.all_token_ids[start : start + n]
