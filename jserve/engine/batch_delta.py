"""Each batch's `BatchDelta`: what a runner that keeps its sequences between steps (the JAX
runner's persistent batch) must change, rather than every table and setting again, as
vLLM v1's scheduler sends new and cached requests' data to its persistent input batch."""

from __future__ import annotations

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.engine.batch import BatchDelta, PenaltySettings, SequenceSettings, TokenRuleSettings
from jserve.engine.live_requests import LiveRequests
from jserve.engine.request import Request


class DeltaTracker:
    """Remembers which sequences the runner has been sent the settings of."""

    def __init__(self, live: LiveRequests, blocks: BlockManager) -> None:
        self.live = live
        self.blocks = blocks
        self._sent: set[int] = set()

    def take(self, seq_ids: np.ndarray) -> BatchDelta:
        """The delta of a batch running `seq_ids`: those not sent yet, tables changed and
        sequences ended since the previous batch."""
        ended = tuple(self.live.take_ended())
        self._sent.difference_update(ended)
        new = [s for s in seq_ids.tolist() if s not in self._sent]
        self._sent.update(new)
        reqs = [self.live.requests[s] for s in new]
        settings = SequenceSettings(
            np.asarray(new, np.int64),
            np.array([r.params.temperature for r in reqs], np.float32),
            np.array([r.params.top_p for r in reqs], np.float32),
            np.array([r.params.top_k for r in reqs], np.int32),
            np.array([_seed(r) for r in reqs], np.uint32), _penalties(reqs), _rules(reqs))
        return BatchDelta(settings, self.blocks.take_changes(), ended)

    def discard(self) -> None:
        """A batch without inputs (the simulator's): nothing to send, nothing to keep."""
        self.live.take_ended()
        self.blocks.discard_changes()


def _penalties(reqs: list[Request]) -> PenaltySettings | None:
    """The new sequences' penalties, None where none has one (the common case sends nothing)."""
    ps = [r.params for r in reqs]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in ps):
        return None
    return PenaltySettings(
        np.array([p.presence_penalty for p in ps], np.float32),
        np.array([p.frequency_penalty for p in ps], np.float32),
        np.array([p.repetition_penalty for p in ps], np.float32),
        np.array([len(r.prompt_token_ids) for r in reqs], np.int32),
        tuple(np.asarray(r.prompt_token_ids if r.params.repetition_penalty != 1 else (), np.int32)
              for r in reqs))


def _rules(reqs: list[Request]) -> TokenRuleSettings | None:
    """The new sequences' biases, bans and minimum lengths, None where none has one."""
    ps = [r.params for r in reqs]
    if not any(p.has_token_rules for p in ps):
        return None
    biases = [dict(p.logit_bias) for p in ps]
    for b, p in zip(biases, ps):
        b.update(dict.fromkeys(p.bad_word_ids, -np.inf))
    return TokenRuleSettings(
        tuple(np.fromiter(b, np.int32, len(b)) for b in biases),
        tuple(np.fromiter(b.values(), np.float32, len(b)) for b in biases),
        np.array([p.min_tokens for p in ps], np.int32),
        tuple(np.asarray(p.min_tokens_stop_ids, np.int32) for p in ps))


def _seed(req: Request) -> int:
    """Per-request RNG seed: the user's, or one derived from the engine's seq id."""
    seed = req.params.seed if req.params.seed is not None else req.seq_id * 2654435761
    return seed & 0xFFFFFFFF
