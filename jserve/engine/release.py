"""Ending a request, whatever ends it (a stop, its length, an abort): its final text and
reason, every block it holds given back (its full computed blocks kept in the prefix
cache for its conversation's next turn), its row recycled."""

from __future__ import annotations

from dataclasses import dataclass, field

from jserve.cache.blocks import BlockManager
from jserve.cache_features.protocol import CacheFeature
from jserve.engine.live_requests import LiveRequests
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.request import FinishReason, Request, RequestStatus


@dataclass
class Finisher:
    live: LiveRequests
    blocks: BlockManager
    host_blocks: BlockManager | None
    reuse: PrefixReuse | None
    features: tuple[CacheFeature, ...]
    # Requests that ended while swapped out: the runner drops their host copy.
    _host_dropped: list[int] = field(default_factory=list, init=False)

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        self.end(req, reason, now)
        self.release(req, now)

    def end(self, req: Request, reason: FinishReason, now: float) -> None:
        """What the caller sees: the final text, the reason and the time. The pipelined loop
        releases a request that reaches its length first and ends it once its last token
        is read."""
        if req.detokenizer is not None and reason is not FinishReason.STOP:
            req.text += req.detokenizer.flush()
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = now

    def release(self, req: Request, now: float) -> None:
        """What the engine gets back: every block, slot and row the request holds."""
        if self.reuse is not None:
            self.reuse.cache_turn(req, now)
        self.blocks.free(req.seq_id)
        row = self.live.row(req.seq_id)
        for feature in self.features:
            feature.drop(req.seq_id, row)
        if self.host_blocks is not None and self.host_blocks.free(req.seq_id):
            self._host_dropped.append(req.seq_id)
        self.live.remove(req)

    def take_host_dropped(self) -> list[int]:
        """Requests that ended while swapped out since the last call."""
        dropped, self._host_dropped = self._host_dropped, []
        return dropped
