"""The policy contract: a pure function from a snapshot to a plan."""

from __future__ import annotations

from typing import Protocol

from jserve.engine.plan import Plan
from jserve.engine.view import SchedulerView


class Policy(Protocol):
    """Reads a `SchedulerView`, returns a `Plan`, mutates nothing.

    Policies are plain objects holding only their configuration, so the same instance runs
    on the real engine, in the simulator, and under random-trace property tests.

    A policy that allocates by predicted output length also names its predictor in a
    `predictor_kind` attribute (`cacheopt`, `rlp`, `s3`); the engine's front ends then fill
    each request's `predicted_len` / `predicted_dir` when it arrives.

    A policy that keeps some requests' layers on the host (`layer_offload` section, LayerKV) says so
    with a true `offloads_layers` attribute: the real runner then sets aside staging blocks
    for those requests' prefills and a per-layer host pool (`runners/jax_runner.py`).
    One that may put requests on the hidden cache (`hidden_cache` section, Apt-Serve) says so
    with a true `uses_hidden_cache`: the runner's warm-up then compiles those steps too.
    """

    name: str
    chunked_prefill: bool  # whether it may run a prompt over several steps

    def schedule(self, view: SchedulerView) -> Plan: ...
