"""Prometheus metrics of a serving engine, for `/metrics`: jserve's own (`jserve_*`) and
vLLM's (`vllm:*`, with vLLM's names, types, buckets and `model_name` / `engine` labels), so
dashboards and alerts written for `vllm serve` read a jserve server unchanged.

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
from jserve.engine.request import FinishReason, Request, RequestStatus

# Bucket bounds in seconds: TTFT spans a fast decode to a long queue; TBT one step to a stall.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# vLLM's own bounds (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_LABELS = ("model_name", "engine")  # vLLM's; jserve has one engine, "0"


class VllmMetrics:
    """vLLM's metrics of one served model, each already bound to its labels."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = (model_name, "0")

        def make(kind: type, name: str, doc: str, **kw: object):
            return kind(name, doc, VLLM_LABELS, registry=registry, **kw).labels(*labels)

        self.running = make(Gauge, "vllm:num_requests_running", "Requests holding KV blocks")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Requests queued (never started or preempted)")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (1 is all)")
        self.preemptions = make(Counter, "vllm:num_preemptions", "Requests preempted")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of requests that got their first token")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Output tokens generated")
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         "Arrival to first token", buckets=VLLM_TTFT_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds",
                        "Gap between consecutive output tokens", buckets=VLLM_ITL_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        "Arrival to the last token", buckets=VLLM_REQUEST_BUCKETS)
        self.queue = make(Histogram, "vllm:request_queue_time_seconds",
                          "Arrival to first scheduled", buckets=VLLM_REQUEST_BUCKETS)
        success = Counter("vllm:request_success", "Requests that ran to their end, by finish reason",
                          (*VLLM_LABELS, "finished_reason"), registry=registry)
        # requests that ran to their end (an aborted one never reaches `observe_tokens`)
        self.success = {reason: success.labels(*labels, reason.value)
                        for reason in (FinishReason.STOP, FinishReason.LENGTH)}


class ServerMetrics:
    """One registry per server, so several servers in one process (tests) stay apart."""

    def __init__(self, model_name: str = "") -> None:
        """`model_name`: vLLM's metrics' `model_name` label (the first served name)."""
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
        self.vllm = VllmMetrics(r, model_name)
        self._seen = {"num_preemptions": 0, "num_steps": 0}  # engine.stats already counted
        self.num_waiting = 0  # the waiting gauge's value, for admission control

    def observe_tokens(self, req: Request, num_seen: int) -> None:
        """Record `req`'s tokens after the first `num_seen` (called after every step it
        advanced in): their latencies and counts, its prompt with its first token, and its
        end-to-end and queue times once it has finished."""
        times, m = req.metrics.token_times, req.metrics
        if num_seen == 0 and times:
            self.ttft.observe(times[0] - m.arrival_time)
            self.vllm.ttft.observe(times[0] - m.arrival_time)
            self.vllm.prompt_tokens.inc(len(req.prompt_token_ids))
        self.vllm.generation_tokens.inc(max(0, len(times) - num_seen))
        for i in range(max(num_seen, 1), len(times)):
            self.tbt.observe(times[i] - times[i - 1])
            self.vllm.itl.observe(times[i] - times[i - 1])
        if req.finished and m.finished_time is not None and req.finish_reason in self.vllm.success:
            self.vllm.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.vllm.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.vllm.success[req.finish_reason.value].inc()

    def update(self, engine: Engine) -> None:
        """Gauges and counters from the engine's state; call between steps."""
        state = engine.state
        status = state.snapshot(engine.clock()).requests.status
        blocks = state.blocks
        running = int((status == RequestStatus.RUNNING).sum())
        self.num_waiting = int((status == RequestStatus.WAITING).sum())
        for gauge, value in ((self.running, running), (self.vllm.running, running),
                             (self.waiting, self.num_waiting), (self.vllm.waiting, self.num_waiting),
                             (self.free_blocks, blocks.num_free), (self.cached_blocks, blocks.num_evictable),
                             (self.total_blocks, blocks.num_blocks)):
            gauge.set(value)
        # vLLM counts cached blocks no request holds as free: they are evicted on demand
        self.vllm.kv_usage.set(1 - (blocks.num_free + blocks.num_evictable) / blocks.num_blocks)
        for counters, name in (((self.preemptions, self.vllm.preemptions), "num_preemptions"),
                               ((self.steps,), "num_steps")):
            total = getattr(engine.stats, name)
            for counter in counters:
                counter.inc(total - self._seen[name])
            self._seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
