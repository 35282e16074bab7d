"""Swap preemption: a preempted request's KV moves to the host tier instead of being
dropped, and a later plan brings it back into fresh device blocks (vLLM v0's `swap` mode)."""
