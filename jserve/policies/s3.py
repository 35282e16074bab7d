"""S3 (Jin et al., "S3: Increasing GPU Utilization during Generative Inference for Higher
Throughput", the CacheOpt paper's S3 baseline): allocate the predicted output length's
bucket, and double it for a request that outgrew it.

- The predictor classifies the output length into 50-token buckets (`bucket_tokens`); a
  request is reserved its prompt plus the upper edge of its bucket (prediction p lies in
  (50k, 50k + 50]: reserved 50k + 50 output tokens), capped at `max_len`. Without a
  prediction (`predicted_len == 0`) it is reserved `max_len`.
- A request that exhausts its reservation is preempted (S3 does not extend an allocation
  in place) by swapping, S3's default preemption strategy (the CacheOpt paper, Section
  2.5), or by recompute when the host has no room; on re-admission its output demand
  doubles for every preemption it has had: `bucket * 2**num_preemptions`, capped at
  `max_len`, so it converges. (A swapped-out request keeps its KV, so it comes back by a
  swap-in, reserved its doubled demand when the pool has it.)
- Otherwise vLLM's loop: FCFS whole-prompt admissions, prefill-first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities
from jserve.engine.view import SchedulerView
from jserve.policies.reservation import (
    demand_blocks,
    latest_arrival_first,
    schedule_prefill_first,
)


def bucket_upper(predicted: int, bucket: int) -> int:
    """The upper edge of the bucket holding a predicted output length, bucket b holding
    (b * bucket, (b + 1) * bucket] as the S3 predictor's classes do: an edge maps to itself,
    so the shipped predictor's output (already an upper edge) is taken as it is."""
    return max(1, -(-predicted // bucket)) * bucket


@dataclass(frozen=True)
class S3Policy:
    name: str = "s3"
    chunked_prefill: bool = False
    bucket_tokens: int = 50
    capabilities: ClassVar[PolicyCapabilities] = PolicyCapabilities(predictor_kind="s3", reserves=True)

    def demand_tokens(self, view: SchedulerView, i: int) -> int | None:
        r = view.requests
        pred = int(r.predicted_len[i])
        if pred <= 0:
            return None
        doublings = min(int(r.num_preemptions[i]), 30)  # beyond 2**30 the cap decides anyway
        return int(r.prompt_len[i]) + bucket_upper(pred, self.bucket_tokens) * 2**doublings

    def schedule(self, view: SchedulerView) -> Plan:
        return schedule_prefill_first(
            view, lambda i: demand_blocks(view, i, self.demand_tokens(view, i)),
            latest_arrival_first(view), wants_swap=lambda i: True, extend=False)
