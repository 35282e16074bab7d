"""Scheduling / KV-allocation policies, one file per policy, looked up by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from jserve.plan import PreemptMode

from jserve.policies.base import Policy
from jserve.policies.fastgen import FastGenPolicy
from jserve.policies.sarathi import SarathiPolicy
from jserve.policies.vllm import VLLMPolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    "vllm": VLLMPolicy,
    "vllm-swap": partial(VLLMPolicy, name="vllm-swap", preemption_mode=PreemptMode.SWAP),
    "sarathi": SarathiPolicy,
    "fastgen": FastGenPolicy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}") from None


__all__ = ["POLICIES", "Policy", "make_policy"]
