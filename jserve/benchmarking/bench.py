"""Serving benchmarks: one trace through the real engine, the simulator or a running
server over HTTP, summarised.

The real engine and the simulator share everything but the runner and the clock: the
same `EngineState`, policy, trace replay and metrics. The HTTP backend sends the same
trace with the same prompts and sampling settings, and its records feed the same metrics.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from jserve.benchmarking.conversations import (
    ConversationArrivals,
    ScheduledConversation,
    ScheduledTurn,
    conversation_futures,
    multiturn_summary,
    run_conversations,
    schedule_conversations,
    synthetic_message_ids,
)
from jserve.benchmarking.metrics import (
    EngineTotals,
    RequestRecord,
    Summary,
    assign_slos,
    summarize,
)
from jserve.benchmarking.replay import replay
from jserve.benchmarking.workload import (
    Trace,
    TraceRequest,
    build_trace,
    load_trace,
    multiturn_conversations,
)
from jserve.cache.prefix import ConversationFutures, PrefixCacheConfig
from jserve.cache.sizing import block_bytes
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.policies import make_policy
from jserve.policies.tail_optimized_lru import eviction_rule_for
from jserve.runners.cost_model import CalibratedCostModel, CostModel, RooflineCostModel
from jserve.runners.hardware import get_hardware, kv_capacity_blocks
from jserve.runners.preemption_cost import preemption_costs_from_cost_model
from models.registry import DEFAULT_MODEL, get_config


@dataclass(frozen=True)
class BenchConfig:
    engine: Literal["real", "sim"] = "sim"
    backend: Literal["inprocess", "http"] = "inprocess"  # http: a running `jserve serve`
    url: str | None = None  # the server's base URL (http backend)
    policy: str = "vllm"
    workload: str = "sharegpt"
    rate: float = math.inf  # requests/s; inf = all at t=0
    num_requests: int = 1000
    model: str = DEFAULT_MODEL
    hardware: str = "a100-80g"  # simulator only
    cv: float = 1.0  # arrival burstiness (1 = Poisson)
    ttft_slo: float | None = None  # seconds
    tbt_slo: float | None = None  # seconds, judged on each request's P99 TBT
    slo_scale: tuple[float, float] | None = None  # per-request SLO = SLO x U[lo, hi] (CacheOpt)
    seed: int = 0
    max_total_len: int = 2048  # prompt + output cap, also the engine's max_model_len
    num_blocks: int | None = None  # default: from memory (real) or the hardware (sim)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9  # simulator KV sizing, as vLLM's setting
    swap_space: float = 4.0  # GiB of host memory for swapped-out K/V (vLLM's default)
    # What prediction-based policies (cacheopt, rlp, s3) see: draws from their trained
    # predictor's noise model, the true lengths, or nothing.
    predictions: Literal["noise", "oracle", "none"] = "noise"
    profile: str | None = None  # calibrated cost profile for the simulator (jserve profile)
    trace: str | None = None  # replay this JSONL trace instead of sampling one
    # Prefix cache: an eviction rule's name (`jserve.policies.tail_optimized_lru`) or
    # "none"; its capacity in tokens of unreferenced KV (None: all free memory), whether
    # conversations are isolated, and T-LRU's TTFT threshold xi in seconds.
    prefix_cache: str = "none"
    cache_capacity: int | None = None
    cache_isolation: bool = False
    tel_threshold: float = 0.2
    host_cache_capacity: int = 0  # tokens of host memory evicted blocks are demoted to
    # sharegpt-multiturn runs closed-loop conversations (`jserve.benchmarking.conversations`): `rate`
    # new conversations per second, `num_requests` conversations, turns spaced by this
    # process's think times.
    conversation_process: Literal["birth-death", "think-time"] = "birth-death"
    turn_rate: float = 0.1  # birth-death: mean of each conversation's turn rate, 1/s
    end_rate: float = 0.05  # birth-death: rate at which a conversation ends, 1/s
    think_time: float = 5.0  # think-time: seconds between a reply and the next turn

    def __post_init__(self) -> None:
        if self.engine not in ("real", "sim"):
            raise ValueError(f"engine must be 'real' or 'sim', not {self.engine!r}")
        if self.backend not in ("inprocess", "http"):
            raise ValueError(f"backend must be 'inprocess' or 'http', not {self.backend!r}")
        if self.backend == "http" and (self.engine != "real" or not self.url):
            raise ValueError("the http backend benchmarks a real server: engine='real' and a url")
        if self.multiturn and self.backend == "http":
            raise ValueError("multi-turn conversations run in process only (the next turn is "
                             "built from the engine's reply)")

    @property
    def multiturn(self) -> bool:
        """Closed-loop conversations rather than a replayed trace."""
        return self.workload == "sharegpt-multiturn" and self.trace is None

    def prefix_cache_config(self, futures: ConversationFutures | None = None) -> PrefixCacheConfig | None:
        """The prefix cache asked for (None: off); `futures` for the oracle rules."""
        if self.prefix_cache == "none":
            return None
        return PrefixCacheConfig(self.prefix_cache, self.cache_capacity, self.cache_isolation,
                                 self.tel_threshold, self.host_cache_capacity, futures)


@dataclass
class BenchResult:
    config: BenchConfig
    summary: Summary
    records: list[RequestRecord]
    wall_time: float  # seconds this process spent
    num_steps: int
    num_preemptions: int
    num_blocks: int
    # Closed-loop conversations: TTFT percentiles, TEL and SLO violations over every turn
    # (`jserve.benchmarking.conversations.multiturn_summary`), and the prompt tokens the cache served.
    multiturn: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        cfg["rate"] = "inf" if math.isinf(self.config.rate) else self.config.rate
        return {
            "config": cfg,
            "summary": self.summary.to_dict(),
            "wall_time_s": self.wall_time,
            "num_steps": self.num_steps,
            "num_blocks": self.num_blocks,
            "multiturn": self.multiturn,
            "requests": [dataclasses.asdict(r) for r in self.records],
        }


def make_trace(cfg: BenchConfig) -> Trace:
    """The config's trace, with per-request SLOs attached when they are scaled."""
    trace = load_trace(cfg.trace) if cfg.trace else build_trace(
        cfg.workload, cfg.num_requests, cfg.rate, cfg.cv, cfg.seed, cfg.max_total_len)
    if cfg.slo_scale is None:
        return trace
    if cfg.ttft_slo is None or cfg.tbt_slo is None:
        raise ValueError("scaled SLOs need both --ttft-slo and --tbt-slo")
    slos = assign_slos(len(trace.requests), cfg.ttft_slo, cfg.tbt_slo, cfg.slo_scale, cfg.seed)
    requests = tuple(dataclasses.replace(r, ttft_slo=a, tbt_slo=b)
                     for r, (a, b) in zip(trace.requests, slos))
    return dataclasses.replace(trace, requests=requests)


def _limits(cfg: BenchConfig) -> SchedulerLimits:
    return SchedulerLimits.with_default_budget(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                               cfg.max_total_len)


def sim_engine(cfg: BenchConfig, futures: ConversationFutures | None = None) -> tuple[Engine, VirtualClock]:
    """The simulator: the real engine state and policy, a cost-model runner, virtual time.
    `futures`: the conversations' future turns, for the oracle eviction rules."""
    from jserve.runners.jax_runner import Buckets
    from jserve.runners.sim_runner import SimRunner

    model = get_config(cfg.model)
    hw = get_hardware(cfg.hardware)
    roofline = RooflineCostModel(model, hw)
    cost: CostModel = CalibratedCostModel.load(cfg.profile, extras=roofline) if cfg.profile else roofline
    num_blocks = cfg.num_blocks or kv_capacity_blocks(
        model, hw, cfg.block_size, utilization=cfg.gpu_memory_utilization)
    policy = make_policy(cfg.policy)
    if hasattr(policy, "preemption_costs"):  # CacheOpt: swap-vs-recompute from this machine
        costs = preemption_costs_from_cost_model(cost, model.kv_bytes_per_token, hw.pcie_bandwidth)
        policy = dataclasses.replace(policy, preemption_costs=costs)
    block = block_bytes(model, cfg.block_size, dtype_bytes=2)
    cache = cfg.prefix_cache_config(futures)
    state = EngineState(num_blocks=num_blocks, block_size=cfg.block_size, limits=_limits(cfg),
                        eos_token_id=None, vocab_size=model.vocab_size,
                        chunked_prefill=policy.chunked_prefill,
                        num_host_blocks=int(cfg.swap_space * 2**30 // block),
                        **(cache.state_options(cfg.block_size) if cache else {}))
    clock = VirtualClock()
    # A profile was measured on the bucketed JAX runner: model its padding too.
    pad = Buckets.for_limits(state.limits, cfg.block_size).tokens if cfg.profile else None
    runner = SimRunner(cost, clock, pad=pad, bytes_per_block=block)
    eviction = eviction_rule_for(cache) if cache else None
    return Engine(state, policy, runner, clock.now, eviction=eviction), clock


def trace_predictions(cfg: BenchConfig, trace: Trace) -> dict[str, tuple[int, int]] | None:
    """Output-length predictions for a prediction-based policy, by request id: drawn from
    its trained predictor's noise model (calibrated on held-out errors; serving benchmarks
    run synthetic prompts the predictor cannot read), or the true lengths."""
    kind = getattr(make_policy(cfg.policy), "predictor_kind", None)
    if kind is None or cfg.predictions == "none":
        return None
    if cfg.predictions == "oracle":
        return {r.request_id: (r.output_len, 0) for r in trace.requests}
    from jserve.predictor import load_noise_model

    draws = load_noise_model(kind).sample([r.output_len for r in trace.requests],
                                          np.random.default_rng(cfg.seed))
    return {r.request_id: p.columns for r, p in zip(trace.requests, draws)}


def run_benchmark(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    if cfg.multiturn:
        return run_conversation_benchmark(cfg, progress)
    trace = make_trace(cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        label = "http" if cfg.backend == "http" else cfg.engine
        bar = tqdm(total=len(trace.requests), desc=f"{label}:{cfg.policy}", unit="req")
    on_finish = (lambda _: bar.update(1)) if bar is not None else None
    t0 = time.perf_counter()
    if cfg.backend == "http":
        from jserve.benchmarking.http_client import replay_http

        run = replay_http(cfg.url, cfg.model, cfg.policy, trace,
                          random_prompt_ids(get_config(cfg.model).vocab_size, cfg.seed), on_finish)
        records, totals = run.records, run.totals
    else:
        if cfg.engine == "sim":
            engine, clock = sim_engine(cfg)
            prompt_ids = _dummy_prompt_ids if cfg.prefix_cache == "none" else _distinct_prompt_ids(cfg)
        else:
            engine, clock, prompt_ids = _real_engine(cfg)
        records = replay(engine, trace, clock, prompt_ids, on_finish=on_finish,
                         predictions=trace_predictions(cfg, trace))
        totals = EngineTotals(engine.stats.num_steps, engine.stats.num_preemptions,
                              engine.state.blocks.num_blocks)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    summary = summarize(records, None if cfg.slo_scale else cfg.ttft_slo,
                        None if cfg.slo_scale else cfg.tbt_slo)
    return BenchResult(cfg, summary, records, wall, totals.num_steps, totals.num_preemptions,
                       totals.num_blocks)


def conversation_schedule(cfg: BenchConfig) -> list[ScheduledConversation]:
    """`num_requests` ShareGPT conversations (fitted to `max_total_len`), starting at
    `rate` per second, with the config's think-time process."""
    arrivals = ConversationArrivals(cfg.conversation_process, cfg.rate, turn_rate=cfg.turn_rate,
                                    end_rate=cfg.end_rate, think_time=cfg.think_time)
    chats = multiturn_conversations(cfg.num_requests, cfg.seed, cfg.max_total_len)
    return schedule_conversations(chats, arrivals, cfg.seed)


def run_conversation_benchmark(cfg: BenchConfig, progress: bool = True,
                               schedule: list[ScheduledConversation] | None = None) -> BenchResult:
    """Closed-loop multi-turn chat: each turn's prompt is its history plus a new message,
    arriving a think time after the previous reply (`jserve.benchmarking.conversations`)."""
    schedule = conversation_schedule(cfg) if schedule is None else schedule
    t0 = time.perf_counter()
    if cfg.engine == "sim":
        engine, clock = sim_engine(cfg, conversation_futures(schedule))
        vocab = get_config(cfg.model).vocab_size

        def message_ids(cid: str, k: int, turn: ScheduledTurn) -> list[int]:
            return synthetic_message_ids(cid, k, turn.new_tokens, vocab)
    else:
        engine, clock, encode = _real_engine(cfg, conversation_futures(schedule))

        def message_ids(cid: str, k: int, turn: ScheduledTurn) -> list[int]:
            return encode(turn.prompt, turn.new_tokens, cid, k)
    records = run_conversations(engine, schedule, clock, message_ids, progress=progress)
    wall = time.perf_counter() - t0
    plain = [r.record for r in records]
    multiturn = multiturn_summary(records, cfg.tel_threshold)
    multiturn["cached_prompt_fraction"] = (
        sum(r.num_cached_tokens for r in plain) / max(sum(r.prompt_len for r in plain), 1))
    multiturn["num_evicted_blocks"] = engine.stats.num_evicted_blocks
    return BenchResult(cfg, summarize(plain, cfg.ttft_slo, cfg.tbt_slo), plain, wall,
                       engine.stats.num_steps, engine.stats.num_preemptions,
                       engine.state.blocks.num_blocks, multiturn)


def random_prompt_ids(vocab_size: int, seed: int) -> Callable[[int], list[int]]:
    """Prompts for synthetic workloads: seeded random ids (above the usual special ids),
    drawn in trace order so every backend sends the same prompts for one seed."""
    rng = np.random.default_rng(seed)
    return lambda n: rng.integers(3, vocab_size, n).tolist()


def _dummy_prompt_ids(req: TraceRequest) -> list[int]:
    return [0] * req.prompt_len


def _distinct_prompt_ids(cfg: BenchConfig) -> Callable[[TraceRequest], list[int]]:
    """Simulated prompts that share no prefix by accident (with a prefix cache on, all-zero
    prompts would all hit one another)."""
    vocab = get_config(cfg.model).vocab_size
    return lambda req: synthetic_message_ids(req.request_id, 0, req.prompt_len, vocab)


def _real_engine(cfg: BenchConfig, futures: ConversationFutures | None = None
                 ) -> tuple[Engine, WallClock, Callable[..., list[int]]]:
    """The real engine, and how its prompts are made: a trace request's ids, or with
    `futures` (conversations) a turn's new message's ids from (text, length, id, turn)."""
    from jserve.serving.llm import LLM

    llm = LLM(cfg.model, policy=cfg.policy, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
              max_model_len=cfg.max_total_len, max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, swap_space=cfg.swap_space,
              prefix_cache=cfg.prefix_cache_config(futures), warmup=True)
    tokenizer = llm.tokenizer
    vocab = llm.config.vocab_size
    if futures is not None:
        def message_ids(text: str | None, n: int, cid: str, k: int) -> list[int]:
            if text and tokenizer is not None:
                return tokenizer.encode(text)
            return synthetic_message_ids(cid, k, n, vocab)

        return llm.engine, WallClock(), message_ids
    random_ids = random_prompt_ids(vocab, cfg.seed)

    def prompt_ids(req: TraceRequest) -> list[int]:
        # Text is tokenized as the trace measured it; synthetic prompts get random ids.
        if req.prompt is not None and tokenizer is not None:
            return tokenizer.encode(req.prompt)
        return random_ids(req.prompt_len)

    return llm.engine, WallClock(), prompt_ids
