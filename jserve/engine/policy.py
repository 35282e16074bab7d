"""The policy contract: a pure function from a snapshot to a plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.engine.plan import Plan
from jserve.engine.preemption_costs import PreemptionCosts
from jserve.engine.view import SchedulerView

PredictorKind = Literal["cacheopt", "rlp", "s3"]


@dataclass(frozen=True)
class PolicyCapabilities:
    """What the engine around a policy must know of it before its first step, in one typed
    place: the builder sizes the runner and host tier by it, the config refuses what it
    cannot run with, and admission asks for predictions only for a policy that reads them.
    The defaults are a plain policy's: whole blocks, KV only, no predictions."""

    # Whose output-length predictions it reads (`predicted_len` / `predicted_dir`): the
    # engine then asks that kind's predictor for each request it admits.
    predictor_kind: PredictorKind | None = None
    # Its plans keep every request's held blocks within its reservation (`Plan.reserve`).
    reserves: bool = False
    # It keeps some requests' layers on the host (`Plan.layers`, LayerKV): the real runner
    # sets aside staging blocks and a per-layer host pool, and no prefix cache runs with it.
    offloads_layers: bool = False
    # It may put requests on the hidden cache (`Plan.cache_type`, Apt-Serve): the runner's
    # warm-up compiles those steps too.
    uses_hidden_cache: bool = False
    # Its prefill batches are padded to their longest prompt (vLLM 0.2.x): a stack that pads
    # charges the padding to its steps, and to no other policy's.
    pads_prompts: bool = False
    # It plans with figures of the runner in use (`RunnerCosts`): the builder builds it
    # with them (`ReadsRunnerCosts.given`).
    reads_runner_costs: bool = False


PLAIN = PolicyCapabilities()


class Policy(Protocol):
    """Reads a `SchedulerView`, returns a `Plan`, mutates nothing.

    Policies are plain objects holding only their configuration, so the same instance runs
    on the real engine, in the simulator, and under random-trace property tests. What the
    engine must know of one beyond its plans it declares in `capabilities` (`PLAIN` for a
    policy that needs nothing of the kind)."""

    name: str
    chunked_prefill: bool  # whether it may run a prompt over several steps
    capabilities: PolicyCapabilities

    def schedule(self, view: SchedulerView) -> Plan: ...


@dataclass(frozen=True)
class RunnerCosts:
    """What a policy may know of the runner in use, as data: fitted once by the builder to
    the simulator's cost model or to a profile of the real runner, so no policy sees a cost
    model or a clock. None: not fitted (the policy's documented fallback)."""

    preemption: PreemptionCosts | None = None  # CacheOpt's swap or recompute
    layerkv: LayerKVCosts | None = None  # LayerKV's Eqs. 3-4 and decode line


class ReadsRunnerCosts(Policy, Protocol):
    """A policy whose capabilities say `reads_runner_costs`."""

    def given(self, costs: RunnerCosts) -> Policy:
        """This policy planning with `costs` where it was not given its own."""
        ...
