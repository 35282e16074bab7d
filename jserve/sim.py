"""The simulator from Python: one flat config, a run, a sweep over rates.

`jserve bench --engine sim` and `jserve sweep` build a `BenchConfig` (an `EngineConfig` with
`runner="sim"` inside) from their options and call `run_benchmark` / `run_sweep`. This
module is that path for a Python user: `SimConfig` holds the options a simulated
experiment sets, in one flat list, and turns them into the same `BenchConfig`, so a script
and the command line run the same code and get the same numbers. docs/simulator.md
("From Python") documents every option with an example.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from jserve.benchmarking.bench import BenchConfig, BenchResult, run_benchmark
from jserve.benchmarking.metrics import Summary
from jserve.benchmarking.sweep import SweepResult, run_sweep, write_sweep
from jserve.cache.prefix import PrefixCacheConfig
from jserve.config import EngineConfig
from jserve.runners.engine_overhead import EngineOverhead

__all__ = ["BenchResult", "SimConfig", "Summary", "SweepResult", "simulate", "sweep", "write_sweep"]

# SimConfig's options that configure the engine (`EngineConfig` fields); the others are the
# benchmark's (`BenchConfig` fields).
ENGINE_OPTIONS = frozenset({
    "model", "policy", "predictor", "hardware", "cost_model", "engine_overhead", "tensor_parallel_size",
    "profile", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "block_size", "num_blocks", "gpu_memory_utilization", "swap_space", "prefix_cache",
})


def _refuse_unknown_options(cls: type) -> type:
    """Make the dataclass's `__init__` name an unknown option and what it may have meant
    (a misspelt option, or one only the real engine reads), where Python would say only
    "unexpected keyword argument". The typed signature stays the dataclass's."""
    init = cls.__init__
    known = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def checked_init(self, **options) -> None:
        unknown = [name for name in options if name not in known]
        if unknown:
            raise TypeError("; ".join(_unknown_option_message(name, known) for name in unknown)
                            + f". {cls.__name__}'s options: {', '.join(known)}")
        init(self, **options)

    cls.__init__ = checked_init
    return cls


def _unknown_option_message(name: str, known: Sequence[str]) -> str:
    """Why `name` is no simulator option: a real-engine option, or a likely misspelling."""
    if name in {f.name for f in dataclasses.fields(EngineConfig)}:
        return f"{name!r} is an option of the real engine (EngineConfig), which the simulator does not read"
    close = difflib.get_close_matches(name, known, n=1)
    return f"unknown option {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


@_refuse_unknown_options
@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated experiment: the model on simulated GPUs under a serving stack, a
    policy, and the workload replayed through it. Defaults are `jserve bench`'s.

    The options are documented in docs/simulator.md ("From Python"); each keeps the meaning
    of the `EngineConfig` or `BenchConfig` field of the same name. A bad value raises
    `ValueError` with the reason when the config is made, an unknown option `TypeError`.
    """

    # What is simulated: the model, the GPUs, the serving stack, the policy.
    model: str = EngineConfig.model
    hardware: str = EngineConfig.hardware
    tensor_parallel_size: int = EngineConfig.tensor_parallel_size
    cost_model: str = EngineConfig.cost_model
    engine_overhead: str | EngineOverhead | None = EngineConfig.engine_overhead
    profile: str | None = EngineConfig.profile
    policy: str = EngineConfig.policy
    predictor: str = EngineConfig.predictor  # "auto" (the shipped one) or a trained directory
    # The engine's limits and KV cache.
    dtype: str = EngineConfig.dtype
    max_model_len: int | None = EngineConfig.max_model_len
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int | None = EngineConfig.max_num_batched_tokens
    block_size: int = EngineConfig.block_size
    num_blocks: int | None = EngineConfig.num_blocks
    gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization
    swap_space: float | None = EngineConfig.swap_space
    prefix_cache: str | PrefixCacheConfig | None = EngineConfig.prefix_cache
    # The workload, its arrivals and SLOs.
    workload: str = BenchConfig.workload
    rate: float = BenchConfig.rate
    num_requests: int = BenchConfig.num_requests
    cv: float = BenchConfig.cv
    seed: int = BenchConfig.seed
    trace: str | None = BenchConfig.trace
    ttft_slo: float | None = BenchConfig.ttft_slo
    tbt_slo: float | None = BenchConfig.tbt_slo
    tbt_slo_on: str = BenchConfig.tbt_slo_on
    slo_scale: tuple[float, float] | None = BenchConfig.slo_scale
    predictions: Literal["noise", "oracle", "none"] = BenchConfig.predictions
    tel_threshold: float | None = BenchConfig.tel_threshold
    # Multi-turn conversations (workload "sharegpt-multiturn").
    conversation_process: Literal["birth-death", "think-time", "open-loop", "exp-think"] = \
        BenchConfig.conversation_process
    turn_rate: float = BenchConfig.turn_rate
    end_rate: float = BenchConfig.end_rate
    think_time: float = BenchConfig.think_time
    conversation_min_turns: int = BenchConfig.conversation_min_turns

    def __post_init__(self) -> None:
        self.bench_config()  # every check of the engine's and the benchmark's config, now

    def bench_config(self) -> BenchConfig:
        """The `BenchConfig` that `jserve bench --engine sim` builds from the same options."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        engine = EngineConfig(runner="sim", **{k: v for k, v in options.items() if k in ENGINE_OPTIONS})
        return BenchConfig(engine, **{k: v for k, v in options.items() if k not in ENGINE_OPTIONS})


def simulate(config: SimConfig, *, progress: bool = False) -> BenchResult:
    """Replay the config's workload through the simulated engine (`jserve bench --engine
    sim`): `result.summary` holds percentiles and SLO attainment, `result.records` each
    request's times. `progress` shows a bar over the requests."""
    return run_benchmark(config.bench_config(), progress)


def sweep(config: SimConfig, rates: Sequence[float], policies: Sequence[str] | None = None, *,
          workers: int | None = 1, progress: bool = False) -> SweepResult:
    """`config` at each rate for each policy (default: the config's own), as `jserve sweep`
    runs it: `result.results[policy][i]` is the run at `rates[i]`. `workers` local
    processes run the points (1, the default: this process; None: one per CPU); the
    simulator is deterministic, so the results do not depend on it."""
    if not rates:
        raise ValueError("a sweep needs at least one rate")
    names = [policies] if isinstance(policies, str) else list(policies or [config.policy])
    return run_sweep(config.bench_config(), names, list(rates), progress, workers)
