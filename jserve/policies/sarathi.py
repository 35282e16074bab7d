"""Sarathi-Serve (Agrawal et al., OSDI 2024): chunked prefills under a per-step token budget,
decodes first ("stall-free batching"), FCFS, recompute preemption of the lowest-priority
(latest-arrived) request. KV for a prompt is claimed whole at admission, as in the vLLM
chunked-prefill scheduler the paper's system builds on. The paper's default chunk/token
budget for its A100 experiments is 512 tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jserve.engine.plan import Plan
from jserve.engine.policy import PLAIN, PolicyCapabilities
from jserve.engine.view import SchedulerView
from jserve.policies.chunked_prefill import schedule_chunked


@dataclass(frozen=True)
class SarathiPolicy:
    name: str = "sarathi"
    chunked_prefill: bool = True
    capabilities: ClassVar[PolicyCapabilities] = PLAIN
    token_budget: int = 512

    def schedule(self, view: SchedulerView) -> Plan:
        return schedule_chunked(view, self.token_budget, whole_prompt=True)
