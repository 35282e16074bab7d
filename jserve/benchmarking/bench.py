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
    TBT_SLO_MEASURES,
    EngineTotals,
    RequestRecord,
    Summary,
    assign_slos,
    summarize,
    vllm_report,
)
from jserve.benchmarking.replay import replay
from jserve.benchmarking.workload import (
    Trace,
    TraceRequest,
    build_trace,
    check_rate_cv,
    get_workload,
    load_trace,
    multiturn_conversations,
    with_slos,
)
from jserve.builder import BuiltEngine, build_engine
from jserve.cache.prefix import PrefixCacheConfig
from jserve.config import EngineConfig
from jserve.runners.hardware import get_hardware
from jserve.runners.testbeds import simulated_stack

PREDICTIONS: tuple[str, ...] = ("noise", "oracle", "none")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: the engine to build (`EngineConfig`; its policy by name) and the
    workload to replay through it."""

    engine: EngineConfig = dataclasses.field(default_factory=lambda: EngineConfig(runner="sim"))
    backend: Literal["inprocess", "http"] = "inprocess"  # http: a running `jserve serve`
    url: str | None = None  # the server's base URL (http backend)
    workload: str = "sharegpt"
    rate: float = math.inf  # requests/s; inf = all at t=0
    num_requests: int = 1000
    cv: float = 1.0  # arrival burstiness (1 = Poisson)
    ttft_slo: float | None = None  # seconds
    tbt_slo: float | None = None  # seconds, judged on each request's `tbt_slo_on`
    tbt_slo_on: str = "p99-tbt"  # what the TBT SLO bounds: "p99-tbt" or "tpot" (LayerKV's)
    slo_scale: tuple[float, float] | None = None  # per-request SLO = SLO x U[lo, hi] (CacheOpt)
    seed: int = 0
    # What prediction-based policies (cacheopt, rlp, s3) see: draws from their trained
    # predictor's noise model, the true lengths, or nothing.
    predictions: Literal["noise", "oracle", "none"] = "noise"
    trace: str | None = None  # replay this JSONL trace instead of sampling one
    # The xi of the report's tail excess latency; None: the prefix cache's (T-LRU's
    # threshold), or its default without a cache.
    tel_threshold: float | None = None
    # sharegpt-multiturn runs closed-loop conversations (`jserve.benchmarking.conversations`): `rate`
    # new conversations per second, `num_requests` conversations, turns spaced by this
    # process's think times.
    conversation_process: Literal["birth-death", "think-time", "open-loop", "exp-think"] = "birth-death"
    turn_rate: float = 0.1  # birth-death: mean of each conversation's turn rate; open-loop, exp-think: the rate, 1/s
    end_rate: float = 0.05  # birth-death: rate at which a conversation ends, 1/s
    think_time: float = 5.0  # think-time: seconds between a reply and the next turn
    conversation_min_turns: int = 2  # only ShareGPT conversations with at least this many turns

    def __post_init__(self) -> None:
        if not isinstance(self.engine.policy, str):
            raise ValueError("a benchmark names its policy (it labels results and is checked "
                             "against a server's)")
        if self.backend not in ("inprocess", "http"):
            raise ValueError(f"backend must be 'inprocess' or 'http', not {self.backend!r}")
        if self.backend == "http" and (self.engine.runner != "real" or not self.url):
            raise ValueError("the http backend benchmarks a real server: runner='real' and a url")
        if self.trace is None:
            get_workload(self.workload)  # unknown or malformed names fail with the known ones
        check_rate_cv(self.rate, self.cv)
        self.arrivals  # the conversation process and its rates, checked even when unused
        if self.tbt_slo_on not in TBT_SLO_MEASURES:
            raise ValueError(f"tbt_slo_on must be one of {', '.join(TBT_SLO_MEASURES)}, not {self.tbt_slo_on!r}")
        if self.predictions not in PREDICTIONS:
            raise ValueError(f"predictions must be one of {', '.join(PREDICTIONS)}, not {self.predictions!r}")
        for name in ("ttft_slo", "tbt_slo"):
            slo = getattr(self, name)
            if slo is not None and not (math.isfinite(slo) and slo > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {slo!r}")
        if self.slo_scale is not None and not 0 < self.slo_scale[0] <= self.slo_scale[1]:
            raise ValueError(f"slo_scale must satisfy 0 < LO <= HI, got {self.slo_scale}")
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int) \
                or self.num_requests < 1:
            raise ValueError(f"num_requests must be an int >= 1, got {self.num_requests!r}")
        if self.multiturn and self.backend == "http":
            raise ValueError("multi-turn conversations run in process only (the next turn is "
                             "built from the engine's reply)")

    @property
    def multiturn(self) -> bool:
        """Closed-loop conversations rather than a replayed trace."""
        return self.workload == "sharegpt-multiturn" and self.trace is None

    @property
    def arrivals(self) -> ConversationArrivals:
        """How the conversations of a multi-turn run start and follow their replies."""
        return ConversationArrivals(self.conversation_process, self.rate, turn_rate=self.turn_rate,
                                    end_rate=self.end_rate, think_time=self.think_time)

    @property
    def max_total_len(self) -> int:
        """Prompt + output cap of the trace: the engine's max_model_len."""
        return self.engine.limits.max_model_len

    @property
    def report_tel_threshold(self) -> float:
        if self.tel_threshold is not None:
            return self.tel_threshold
        return (self.engine.prefix_cache or PrefixCacheConfig()).tel_threshold

    def with_policy(self, policy: str, rate: float) -> BenchConfig:
        """The same benchmark of another policy at another rate (a sweep's point)."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, policy=policy),
                                   rate=rate)


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
    num_swaps: int | None = None  # preemptions by swap (in-process runs; None over HTTP)

    @property
    def vllm(self) -> dict[str, float | int | None]:
        """`vllm bench serve`'s figures under its names (`metrics.vllm_report`)."""
        return vllm_report(self.records, self.summary)

    def to_json(self) -> dict[str, Any]:
        """vLLM's keys at the top level (as `vllm bench serve --save-result` writes them),
        jserve's own summary beside them."""
        return {
            **self.vllm,
            "config": config_json(self.config),
            "simulated": simulated_json(self.config),
            "summary": self.summary.to_dict(),
            "wall_time_s": self.wall_time,
            "num_steps": self.num_steps,
            "num_blocks": self.num_blocks,
            "num_swaps": self.num_swaps,
            "multiturn": self.multiturn,
            "requests": [dataclasses.asdict(r) for r in self.records],
        }


def config_json(cfg: BenchConfig) -> dict[str, Any]:
    """The config as JSON (an infinite rate as "inf")."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d.update(engine=cfg.engine.to_dict(), rate="inf" if math.isinf(cfg.rate) else cfg.rate)
    return d


def simulated_json(cfg: BenchConfig) -> dict[str, str] | None:
    """The GPU model and serving-stack profile a simulated run was charged for (None for a
    real run)."""
    e = cfg.engine
    if e.runner != "sim" or cfg.backend != "inprocess":
        return None
    return simulated_stack(e.cost_model, get_hardware(e.hardware), e.engine_overhead, e.profile)


def make_trace(cfg: BenchConfig) -> Trace:
    """The config's trace, with per-request SLOs attached: scaled ones, or the fixed
    SLOs given, so that SLO-aware policies (cacheopt, layerkv) see them too."""
    trace = load_trace(cfg.trace) if cfg.trace else build_trace(
        cfg.workload, cfg.num_requests, cfg.rate, cfg.cv, cfg.seed, cfg.max_total_len)
    if cfg.slo_scale is None:
        slos = [(cfg.ttft_slo, cfg.tbt_slo)] * len(trace.requests)
        if cfg.ttft_slo is None and cfg.tbt_slo is None:
            return trace
    elif cfg.ttft_slo is None or cfg.tbt_slo is None:
        raise ValueError("scaled SLOs need both --ttft-slo and --tbt-slo")
    else:
        slos = assign_slos(len(trace.requests), cfg.ttft_slo, cfg.tbt_slo, cfg.slo_scale, cfg.seed)
    return with_slos(trace, slos)


def trace_predictions(cfg: BenchConfig, trace: Trace) -> dict[str, tuple[int, int]] | None:
    """Output-length predictions for a prediction-based policy, by request id: drawn from
    its trained predictor's noise model (the engine's `predictor` directory's, else the
    shipped one's; calibrated on held-out errors; serving benchmarks run synthetic prompts
    the predictor cannot read), or the true lengths."""
    kind = cfg.engine.make_policy().capabilities.predictor_kind
    if kind is None or cfg.predictions == "none":
        return None
    if cfg.predictions == "oracle":
        return {r.request_id: (r.output_len, 0) for r in trace.requests}
    from jserve.predictor import load_noise_model

    draws = load_noise_model(kind, cfg.engine.predictor_dir).sample(
        [r.output_len for r in trace.requests], np.random.default_rng(cfg.seed))
    return {r.request_id: p.columns for r, p in zip(trace.requests, draws)}


def run_benchmark(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    if cfg.multiturn:
        return run_conversation_benchmark(cfg, progress)
    trace = make_trace(cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        label = "http" if cfg.backend == "http" else cfg.engine.runner
        bar = tqdm(total=len(trace.requests), desc=f"{label}:{cfg.engine.policy_name}", unit="req")
    on_finish = (lambda _: bar.update(1)) if bar is not None else None
    t0 = time.perf_counter()
    if cfg.backend == "http":
        from jserve.benchmarking.http_client import replay_http

        run = replay_http(cfg.url, cfg.engine.model_name, cfg.engine.policy_name, trace,
                          random_prompt_ids(cfg.engine.model_config().vocab_size, cfg.seed), on_finish)
        records, totals = run.records, run.totals
    else:
        built = build_engine(cfg.engine)
        records = replay(built.engine, trace, built.clock, trace_prompt_ids(cfg, built),
                         on_finish=on_finish, predictions=trace_predictions(cfg, trace))
        stats = built.engine.stats
        totals = EngineTotals(stats.num_steps, stats.num_preemptions, built.engine.state.blocks.num_blocks,
                              stats.num_swaps)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    summary = summarize(records, None if cfg.slo_scale else cfg.ttft_slo,
                        None if cfg.slo_scale else cfg.tbt_slo, cfg.tbt_slo_on)
    return BenchResult(cfg, summary, records, wall, totals.num_steps, totals.num_preemptions,
                       totals.num_blocks, num_swaps=totals.num_swaps)


def conversation_schedule(cfg: BenchConfig) -> list[ScheduledConversation]:
    """`num_requests` ShareGPT conversations (fitted to `max_total_len`), starting at
    `rate` per second, with the config's think-time process."""
    chats = multiturn_conversations(cfg.num_requests, cfg.seed, cfg.max_total_len,
                                    min_turns=cfg.conversation_min_turns)
    return schedule_conversations(chats, cfg.arrivals, cfg.seed)


def run_conversation_benchmark(cfg: BenchConfig, progress: bool = True,
                               schedule: list[ScheduledConversation] | None = None) -> BenchResult:
    """Closed-loop multi-turn chat: each turn's prompt is its history plus a new message,
    arriving a think time after the previous reply (`jserve.benchmarking.conversations`)."""
    schedule = conversation_schedule(cfg) if schedule is None else schedule
    t0 = time.perf_counter()
    built = build_engine(cfg.engine, conversation_futures(schedule))
    tokenizer, vocab = built.tokenizer, built.model_config.vocab_size

    def message_ids(cid: str, k: int, turn: ScheduledTurn) -> list[int]:
        # The real engine tokenizes a turn's text; the simulator reads no token values.
        if turn.prompt and tokenizer is not None:
            return tokenizer.encode(turn.prompt)
        return synthetic_message_ids(cid, k, turn.new_tokens, vocab)

    engine = built.engine
    records = run_conversations(engine, schedule, built.clock, message_ids, progress=progress)
    wall = time.perf_counter() - t0
    plain = [r.record for r in records]
    multiturn = multiturn_summary(records, cfg.report_tel_threshold)
    multiturn["cached_prompt_fraction"] = (
        sum(r.num_cached_tokens for r in plain) / max(sum(r.prompt_len for r in plain), 1))
    multiturn["num_evicted_blocks"] = engine.stats.num_evicted_blocks
    return BenchResult(cfg, summarize(plain, cfg.ttft_slo, cfg.tbt_slo, cfg.tbt_slo_on), plain, wall,
                       engine.stats.num_steps, engine.stats.num_preemptions,
                       engine.state.blocks.num_blocks, multiturn)


def random_prompt_ids(vocab_size: int, seed: int) -> Callable[[int], list[int]]:
    """Prompts for synthetic workloads: seeded random ids (above the usual special ids),
    drawn in trace order so every backend sends the same prompts for one seed."""
    rng = np.random.default_rng(seed)
    return lambda n: rng.integers(3, vocab_size, n).tolist()


def trace_prompt_ids(cfg: BenchConfig, built: BuiltEngine) -> Callable[[TraceRequest], list[int]]:
    """Each trace request's prompt ids. The real engine tokenizes text as the trace measured
    it and gives synthetic prompts random ids. The simulator reads no token values: zeros
    do, unless a prefix cache would match such prompts against one another."""
    vocab = built.model_config.vocab_size
    if cfg.engine.runner == "sim":
        if cfg.engine.prefix_cache is None:
            return lambda req: [0] * req.prompt_len
        return lambda req: synthetic_message_ids(req.request_id, 0, req.prompt_len, vocab)
    tokenizer = built.tokenizer
    random_ids = random_prompt_ids(vocab, cfg.seed)

    def prompt_ids(req: TraceRequest) -> list[int]:
        if req.prompt is not None and tokenizer is not None:
            return tokenizer.encode(req.prompt)
        return random_ids(req.prompt_len)

    return prompt_ids
