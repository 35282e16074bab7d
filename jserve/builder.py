"""Builds an engine from an `EngineConfig`: the real one (the model on this machine's device
through `JaxRunner`, wall clock, the model's tokenizer) or the simulated one (`SimRunner`
charging each step from a cost model, virtual clock).

This is the only place `Engine` and `EngineState` are constructed (`assemble_engine`), so a
change to how the state is made, or a new cache or policy option, is wired once. It is also
where a policy that prices preemption gets its costs, as data fitted to a profile of the
runner in use (`jserve.runners.preemption_cost`), and LayerKV its Eq. 3-4 figures with alpha
and beta fitted the same way (`jserve.runners.layerkv_cost`); the policy never sees a cost
model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp

from jserve.cache.prefix import PrefixCacheConfig
from jserve.cache.sizing import (
    block_bytes,
    device_kv_budget,
    dtype_bytes,
    hidden_block_tokens,
    num_blocks_for_budget,
)
from jserve.config import EngineConfig
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine, Runner
from jserve.engine.admission import PredictionSource
from jserve.engine.policy import Policy, ReadsRunnerCosts, RunnerCosts
from jserve.engine.request import Request
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.policies.tail_optimized_lru import eviction_rule_for
from jserve.runners import multihost
from jserve.runners.cost_model import (
    CalibratedCostModel,
    CostModel,
    RooflineCostModel,
    SwapPath,
    hidden_block_cost,
    prefill_seconds_per_token,
)
from jserve.runners.hardware import get_hardware
from jserve.runners.jax_runner import Buckets, JaxRunner
from jserve.runners.layerkv_cost import fit_lengths, layerkv_costs_from_cost_model
from jserve.runners.preemption_cost import preemption_costs_from_cost_model
from jserve.runners.profiling import load_hidden_profile
from jserve.runners.sharding import TensorParallel, sharded_config
from jserve.runners.sim_runner import SimRunner
from jserve.runners.testbeds import cost_model_info, make_cost_model
from jserve.models.config import ModelConfig
from jserve.models.hf_checkpoint import checkpoint_dtype, is_checkpoint_dir
from jserve.models.loading import LoadedModel, load_model
from jserve.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jserve.benchmarking.conversations import ConversationFutures
    from jserve.predictor import LengthPredictor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    """An engine and what its front end needs beside it."""

    engine: Engine
    clock: WallClock | VirtualClock  # the engine's time; `wait_until` idles to an arrival
    model_config: ModelConfig
    loaded: LoadedModel | None = None  # the real engine's model (weights, tokenizer)
    predictor: LengthPredictor | None = None  # the real engine's output-length predictor

    @property
    def runner(self) -> Runner:
        return self.engine.runner

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer if self.loaded is not None else None


def build_engine(config: EngineConfig, futures: ConversationFutures | None = None) -> BuiltEngine:
    """The engine `config` describes. `futures`: a benchmark's conversations to come, which
    the oracle prefix-cache rules read."""
    cache = config.prefix_cache
    if cache is not None and futures is not None:
        cache = dataclasses.replace(cache, futures=futures)
    return (_build_sim if config.runner == "sim" else _build_real)(config, cache)


def assemble_engine(
    policy: Policy, runner: Runner, clock: Callable[[], float], *, num_blocks: int,
    block_size: int, limits: SchedulerLimits, vocab_size: int, eos_token_id: int | None = None,
    tokenizer: Tokenizer | None = None, num_host_blocks: int = 0,
    prefix_cache: PrefixCacheConfig | None = None, num_layers: int = 1,
    hidden_block_tokens: int = 0, hidden_block_cost: float = 0.0, pipelined: bool = False,
    predictions: PredictionSource | None = None,
) -> Engine:
    """An engine loop over a fresh state, from resolved sizes: what `build_engine` ends in,
    and what tests with a fake runner call directly."""
    state = EngineState(
        num_blocks=num_blocks, block_size=block_size, limits=limits, eos_token_id=eos_token_id,
        vocab_size=vocab_size, tokenizer=tokenizer, chunked_prefill=policy.chunked_prefill,
        num_host_blocks=num_host_blocks, num_layers=num_layers,
        hidden_block_tokens=hidden_block_tokens, hidden_block_cost=hidden_block_cost,
        prefix_cache=prefix_cache.in_blocks(block_size) if prefix_cache else None, predictions=predictions,
        share_forks=not policy.capabilities.offloads_layers,
    )
    eviction = eviction_rule_for(prefix_cache) if prefix_cache else None
    return Engine(state, policy, runner, clock, eviction=eviction, pipelined=pipelined)


def _enable_compilation_cache() -> None:
    """Keep compiled steps on disk so the second start-up skips XLA compilation: all of them,
    not only those over JAX's default 1 s of compiling (a small model's buckets, such as
    tiny-llama's, each compile in under a second and were rebuilt at every start)."""
    if jax.config.jax_compilation_cache_dir is None:
        path = os.environ.get("JSERVE_COMPILE_CACHE", os.path.expanduser("~/.cache/jserve/xla"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _build_real(config: EngineConfig, cache: PrefixCacheConfig | None) -> BuiltEngine:
    multihost.initialize()  # across hosts, before anything touches a device
    _enable_compilation_cache()
    tp_size = config.tensor_parallel_size
    tp = TensorParallel.over(tp_size) if tp_size > 1 else None
    loaded = _load_model(config, tp)
    model = loaded.config
    # The cache as the runner holds it, KV heads repeated where fewer than devices: the
    # budgets (one device's, times the devices) buy blocks of that size.
    held = sharded_config(model, tp_size)
    dbytes = dtype_bytes(loaded.model.embed.embedding.get_value().dtype)
    limits = config.limits
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = (config.kv_cache_space * 2**30 if config.kv_cache_space is not None
                  else _device_kv_budget(held, dbytes, config.gpu_memory_utilization, tp_size))
        num_blocks = num_blocks_for_budget(held, config.block_size, dbytes, budget)
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV cache; pass num_blocks explicitly")
    policy = config.make_policy()
    page = os.sysconf("SC_PAGE_SIZE")
    num_host_blocks = num_blocks_for_budget(held, config.block_size, dbytes, host_tier_bytes(
        config, policy, held, dbytes, page * os.sysconf("SC_PHYS_PAGES")))
    # Sharded, the attention sees each device's KV-head slice of a page, which holds no
    # whole hidden row: no hidden cache on the real engine with tensor parallelism.
    hidden_tokens = hidden_block_tokens(model, config.block_size) if tp is None else 0
    runner = JaxRunner(
        loaded.model, num_blocks=num_blocks, block_size=config.block_size,
        max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len, attention=config.attention,
        layer_staging=policy.capabilities.offloads_layers, num_host_blocks=num_host_blocks,
        hidden_steps=policy.capabilities.uses_hidden_cache and hidden_tokens > config.block_size,
        tensor_parallel=tp,
    )
    # Several processes: this one runs the engine loop (process 0), or follows its steps.
    runner = multihost.coordinate(runner, config.warmup)
    # The real runner's costs come only from a profile measured on it; without one the
    # policy keeps its documented fallback (Apt-Serve: rho 0.0, unknown).
    rho = 0.0
    if config.profile is not None:
        hidden = load_hidden_profile(config.profile)
        rho = hidden.block_cost(hidden_tokens) if hidden is not None else 0.0
        swaps = RooflineCostModel(model, get_hardware(config.hardware), dtype_bytes=dbytes,
                                  swap_path=SwapPath.GATHERED)
        measured = CalibratedCostModel.load(config.profile, extras=swaps)
        cache = _with_prefill_fit(cache, measured)
        policy = _given_costs(policy, lambda: _runner_costs(config, measured, model, dbytes))
    clock = WallClock()
    predictor = _length_predictor(config, policy, loaded)
    engine = assemble_engine(
        policy, runner, clock.now, num_blocks=num_blocks, block_size=config.block_size,
        limits=limits, vocab_size=model.vocab_size, eos_token_id=model.eos_token_id,
        tokenizer=loaded.tokenizer, prefix_cache=cache, num_layers=model.num_layers,
        num_host_blocks=num_host_blocks, hidden_block_tokens=hidden_tokens, hidden_block_cost=rho,
        pipelined=(config.async_scheduling and cache is None and isinstance(runner, JaxRunner)
                   and not policy.capabilities.offloads_layers
                   and not policy.capabilities.uses_hidden_cache),
        predictions=None if predictor is None else PromptPredictions(predictor),
    )
    if config.warmup:
        runner.warmup(progress=True, background=config.background_compile)
    return BuiltEngine(engine, clock, model, loaded, predictor)


@dataclass(frozen=True)
class PromptPredictions:
    """A trained output-length predictor as the engine's prediction source: it reads the
    prompts, a step's arrivals encoded together."""

    predictor: LengthPredictor

    def predict(self, requests: Sequence[Request]) -> list[tuple[int, int]]:
        prompts = [r.prompt_token_ids for r in requests]
        return [p.columns for p in self.predictor.predict_batch(prompts)]


def _length_predictor(config: EngineConfig, policy: Policy, loaded: LoadedModel) -> LengthPredictor | None:
    """The real engine's predictor: none for a policy that reads no predictions or
    `predictor=None`; with 'auto', the shipped one of the policy's kind where it reads the
    served model's tokens; a directory's, which must read them; else the one given."""
    kind = policy.capabilities.predictor_kind
    if config.predictor is None or kind is None:
        return None
    from jserve.predictor import LengthPredictor

    if config.predictor_dir is not None:
        base = LengthPredictor.base_model(config.predictor_dir)
        if base != loaded.config.name:
            raise ValueError(f"predictor {config.predictor_dir} reads {base}'s tokens; this "
                             f"engine serves {loaded.config.name}")
        return LengthPredictor.load(kind, config.predictor_dir, base=loaded)
    if config.predictor != "auto":
        return config.predictor

    if loaded.tokenizer is None or loaded.config.name != LengthPredictor.base_model():
        log.warning("policy %s allocates by predicted length, but the shipped predictor "
                    "reads %s's tokens, not %s's: requests get no prediction",
                    policy.name, LengthPredictor.base_model(), loaded.config.name)
        return None
    return LengthPredictor.load(kind, base=loaded)


# vLLM's default swap space, GiB per device.
DEFAULT_SWAP_SPACE = 4.0
# The share of a real host's memory LayerKV's host tier may take by default (the device
# cache on a CPU takes a quarter likewise).
LAYER_HOST_FRACTION = 0.25


def host_tier_bytes(config: EngineConfig, policy: Policy, model: ModelConfig, dbytes: int,
                    host_memory: float | None = None) -> float:
    """Bytes of the host KV tier over the tensor-parallel group, `model` being the KV as the
    runner holds it: `swap_space` GiB per device (vLLM's option is per device: each holds
    its shard of a block) when given; else vLLM's 4 GiB per device, or, for a policy that
    keeps layers on the host (LayerKV), room for every sequence the engine can hold at its
    longest (`max_num_seqs` x `max_model_len` tokens), which the paper's server has (2,048 GB
    of host memory for eight L20s, Section 5.1) and the simulated host is taken to have;
    on a real host (`host_memory`, bytes) at most `LAYER_HOST_FRACTION` of it, and a host
    whose share cannot hold one longest request is refused."""
    devices = config.tensor_parallel_size
    if config.swap_space is not None:
        return config.swap_space * 2**30 * devices
    if not policy.capabilities.offloads_layers:
        return DEFAULT_SWAP_SPACE * 2**30 * devices
    limits = config.limits
    longest = limits.max_model_len * block_bytes(model, 1, dbytes)
    if host_memory is None:
        return limits.max_num_seqs * longest
    share = LAYER_HOST_FRACTION * host_memory
    if share < longest:
        raise ValueError(f"policy {config.policy_name!r} keeps layers in host memory, and a quarter of "
                         f"this host's {host_memory / 2**30:.1f} GiB cannot hold one {limits.max_model_len}-token "
                         f"request's K/V ({longest / 2**30:.2f} GiB): pass swap_space (--swap-space GIB)")
    return min(limits.max_num_seqs * longest, share)


def _device_kv_budget(model: ModelConfig, dbytes: int, utilization: float, devices: int) -> float:
    """KV bytes over `devices` accelerators, each holding its share of the weights; forced
    CPU devices share one machine's RAM, so there the budget is the machine's."""
    per_device = device_kv_budget(model.num_params * dbytes / devices, utilization)
    return per_device * (1 if jax.default_backend() == "cpu" else devices)


def _load_model(config: EngineConfig, tp: TensorParallel | None) -> LoadedModel:
    """The configured model; a checkpoint's weights are read straight onto `tp`'s mesh."""
    if isinstance(config.model, LoadedModel):
        return config.model
    return load_model(config.model, weights=config.weights, dtype=jnp.dtype(serving_dtype(config)),
                      seed=config.seed, placement=tp)


def serving_dtype(config: EngineConfig) -> str:
    """`config.dtype`, 'auto' resolved: float32 on CPU; on accelerators a checkpoint's own
    half-precision dtype, else bfloat16."""
    if config.dtype != "auto":
        return config.dtype
    if jax.default_backend() == "cpu":
        return "float32"
    stored = checkpoint_dtype(config.model) if is_checkpoint_dir(config.model) else None
    return stored if stored in ("bfloat16", "float16") else "bfloat16"


def sim_cost_model(config: EngineConfig) -> CostModel:
    """The cost model the simulator charges `config`'s steps from: the named `cost_model`
    (`jserve.runners.testbeds`: vLLM as measured by default) of its hardware entry for one
    GPU of a group of `tensor_parallel_size` (work and weights split over the group, two ring
    all-reduces a layer over the entry's interconnect), or the profile's fitted model with a
    roofline pricing what a profile does not measure (the profile is taken as measured on the
    same group: no all-reduce is added to it). `cost.step_time(StepShape...)` is the TP-aware
    step-time prediction; `breakdown` shows its terms (`allreduce` among them)."""
    # A profile was measured on the JAX runner: model its gathered swaps (and, in
    # `_build_sim`, its padding); the named models are of vLLM v0, whose swaps copy block
    # by block.
    if config.profile:
        roofline = RooflineCostModel(config.model_config(), get_hardware(config.hardware),
                                     dtype_bytes=config.sim_dtype_bytes,
                                     tensor_parallel=config.tensor_parallel_size, swap_path=SwapPath.GATHERED)
        return CalibratedCostModel.load(config.profile, extras=roofline)
    stack = cost_model_info(config.cost_model).engine(config.engine_overhead)
    if stack.pads_prompts and not config.make_policy().capabilities.pads_prompts:
        # Only a scheduler whose prompt batches pad (vLLM 0.2.x's) pays for the padding:
        # another scheduler on that stack is taken to run its prompts unpadded, as every
        # vLLM since 0.2.5 does, not as 0.2.x's model runner would pad batches it never formed.
        stack = dataclasses.replace(stack, pads_prompts=False)
    return make_cost_model(config.cost_model, config.model_config(), get_hardware(config.hardware),
                           config.sim_dtype_bytes, config.tensor_parallel_size, SwapPath.PER_BLOCK_LAYER, stack)


def _build_sim(config: EngineConfig, cache: PrefixCacheConfig | None) -> BuiltEngine:
    model = config.model_config()
    dbytes = config.sim_dtype_bytes
    tp = config.tensor_parallel_size
    cost = sim_cost_model(config)
    cache = _with_prefill_fit(cache, cost)
    limits = config.limits
    num_blocks = config.sim_kv_blocks()
    clock = VirtualClock()
    pad = Buckets.for_limits(limits, config.block_size).tokens if config.profile else None
    block = block_bytes(model, config.block_size, dbytes)
    hidden_tokens = hidden_block_tokens(model, config.block_size, tp)
    runner = SimRunner(cost, clock, pad=pad, bytes_per_block=block)
    policy = _given_costs(config.make_policy(), lambda: _runner_costs(config, cost, model, dbytes))
    engine = assemble_engine(
        policy, runner, clock.now, num_blocks=num_blocks, block_size=config.block_size,
        limits=limits, vocab_size=model.vocab_size, prefix_cache=cache, num_layers=model.num_layers,
        num_host_blocks=num_blocks_for_budget(model, config.block_size, dbytes,
                                              host_tier_bytes(config, policy, model, dbytes)),
        hidden_block_tokens=hidden_tokens, hidden_block_cost=hidden_block_cost(cost, hidden_tokens),
    )
    return BuiltEngine(engine, clock, model)


def _with_prefill_fit(cache: PrefixCacheConfig | None, cost: CostModel) -> PrefixCacheConfig | None:
    """T-LRU's xi becomes tokens through a prefill-time line fitted once to the runner's
    cost model or profile (offline, as the paper's footnote 7); a given fit is kept."""
    if cache is None or cache.xi_fit != "offline" or cache.prefill_seconds_per_token is not None:
        return cache
    return dataclasses.replace(cache, prefill_seconds_per_token=prefill_seconds_per_token(cost))


def _runner_costs(config: EngineConfig, cost: CostModel, model: ModelConfig, dbytes: int) -> RunnerCosts:
    """The figures a policy may plan with, fitted to `cost` (the simulator's cost model or
    the real runner's profile) over `model` as the runner holds it."""
    return RunnerCosts(
        preemption=preemption_costs_from_cost_model(cost, config.block_size,
                                                    block_bytes(model, config.block_size, dbytes)),
        layerkv=layerkv_costs_from_cost_model(cost, model, get_hardware(config.hardware), dbytes,
                                              fit_lengths(config.limits.max_model_len)),
    )


def _given_costs(policy: Policy, costs: Callable[[], RunnerCosts]) -> Policy:
    """The policy built with the runner's costs where its capabilities say it reads them
    (fitted only then); any other policy as it is."""
    if not policy.capabilities.reads_runner_costs:
        return policy
    return cast(ReadsRunnerCosts, policy).given(costs())
