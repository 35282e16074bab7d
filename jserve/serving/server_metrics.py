"""Prometheus metrics of a serving engine, for `/metrics`.

Updated only on the event-loop thread between engine steps (the engine's own state is
never read while a step runs); `render` may be called from any handler.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jserve.engine.loop import Engine
from jserve.engine.request import Request, RequestStatus

# Bucket bounds in seconds: TTFT spans a fast decode to a long queue; TBT one step to a stall.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """One registry per server, so several servers in one process (tests) stay apart."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("jserve_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge("jserve_requests_waiting", "Requests queued (never started or "
                             "preempted)", registry=r)
        self.free_blocks = Gauge("jserve_kv_blocks_free", "Free KV cache blocks", registry=r)
        self.total_blocks = Gauge("jserve_kv_blocks_total", "KV cache blocks", registry=r)
        self.cached_blocks = Gauge("jserve_kv_blocks_cached", "KV blocks the prefix cache keeps "
                                   "unreferenced (evictable)", registry=r)
        self.preemptions = Counter("jserve_preemptions", "Requests preempted", registry=r)
        self.steps = Counter("jserve_engine_steps", "Engine iterations run", registry=r)
        self.finished = Counter("jserve_requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("jserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("jserve_time_between_tokens_seconds", "Gap between consecutive "
                             "output tokens", buckets=TBT_BUCKETS, registry=r)
        self._seen = {"num_preemptions": 0, "num_steps": 0}  # engine.stats already counted
        self.num_waiting = 0  # the waiting gauge's value, for admission control

    def observe_tokens(self, req: Request, num_seen: int) -> None:
        """Record the latencies of `req`'s tokens after the first `num_seen`."""
        times = req.metrics.token_times
        if num_seen == 0 and times:
            self.ttft.observe(times[0] - req.metrics.arrival_time)
        for i in range(max(num_seen, 1), len(times)):
            self.tbt.observe(times[i] - times[i - 1])

    def update(self, engine: Engine) -> None:
        """Gauges and counters from the engine's state; call between steps."""
        state = engine.state
        status = state.snapshot(engine.clock()).requests.status
        self.running.set(int((status == RequestStatus.RUNNING).sum()))
        self.num_waiting = int((status == RequestStatus.WAITING).sum())
        self.waiting.set(self.num_waiting)
        self.free_blocks.set(state.blocks.num_free)
        self.cached_blocks.set(state.blocks.num_evictable)
        self.total_blocks.set(state.blocks.num_blocks)
        for counter, name in ((self.preemptions, "num_preemptions"), (self.steps, "num_steps")):
            total = getattr(engine.stats, name)
            counter.inc(total - self._seen[name])
            self._seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
