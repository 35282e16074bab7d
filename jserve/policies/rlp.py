"""RLP: vLLM with prediction-based KV allocation (the CacheOpt paper's RLP baseline).

- Admission FCFS with whole-prompt prefills, prefill-first (vLLM's step structure).
- Each admitted request is reserved its prompt plus the predicted output plus
  `margin_tokens`, capped at `max_len`; without a prediction (`predicted_len == 0`) it is
  reserved `max_len`. The baseline's "regression + 100 tokens" margin belongs to its
  predictor: the shipped RLP predictor (`jserve.predictor`, kind `rlp`) reports the
  regression estimate plus 100, so the policy adds nothing more by default.
- A request that outgrows its reservation (under-provisioned) is preempted by recompute
  and admitted again, reserved afresh, when there is room: the CacheOpt paper's Section 2.1
  ("any underprovisioned requests are preempted and later executed when there is
  sufficient KVC"; Section 2.5: RLP, like vLLM, recomputes). Comes back, its prediction
  is spent: it is reserved its tokens so far plus `retry_margin_tokens` (our choice: RLP's
  own 100-token padding again), or it would be preempted again after every token.
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


@dataclass(frozen=True)
class RLPPolicy:
    name: str = "rlp"
    chunked_prefill: bool = False
    margin_tokens: int = 0
    retry_margin_tokens: int = 100
    capabilities: ClassVar[PolicyCapabilities] = PolicyCapabilities(predictor_kind="rlp", reserves=True)

    def demand_tokens(self, view: SchedulerView, i: int) -> int | None:
        """Predicted total length (prompt + output + margin); None without a prediction."""
        r = view.requests
        pred = int(r.predicted_len[i])
        if pred <= 0:
            return None
        first = int(r.prompt_len[i]) + pred + self.margin_tokens
        if r.num_preemptions[i]:
            return max(first, int(r.num_tokens[i]) + self.retry_margin_tokens)
        return first

    def schedule(self, view: SchedulerView) -> Plan:
        return schedule_prefill_first(
            view, lambda i: demand_blocks(view, i, self.demand_tokens(view, i)),
            latest_arrival_first(view), extend=False)
