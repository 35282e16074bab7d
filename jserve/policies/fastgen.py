"""DeepSpeed-FastGen (Holmes et al., 2024), "Dynamic SplitFuse": decodes first, then prompts
split into chunks (long ones) or composed together (short ones) so every forward pass runs
close to a fixed token budget. KV blocks are claimed chunk by chunk rather than for the
whole prompt up front. The token budget is a deployment setting; 512 matches Sarathi's so
the two differ only in allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jserve.engine.plan import Plan
from jserve.engine.policy import PLAIN, PolicyCapabilities
from jserve.engine.view import SchedulerView
from jserve.policies.chunked_prefill import schedule_chunked


@dataclass(frozen=True)
class FastGenPolicy:
    name: str = "fastgen"
    chunked_prefill: bool = True
    capabilities: ClassVar[PolicyCapabilities] = PLAIN
    token_budget: int = 512

    def schedule(self, view: SchedulerView) -> Plan:
        return schedule_chunked(view, self.token_budget, whole_prompt=False)
