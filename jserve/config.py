"""One engine configuration (what vLLM calls engine args), validated once, and the one place
its command-line options are declared.

Everything that decides how an engine is built lives in `EngineConfig`: the model and its
weights, the policy, the cache and batch limits, the prefix cache, the attention backend, and
what the simulated runner needs (the accelerator and a step-time profile). `jserve.builder`
turns a config into the real engine or the simulated one, so `LLM`, the HTTP server,
`jserve bench`, the simulator, profiling and the tests all build engines the same way, and a
new cache or policy option is added here and in the builder only.

`add_engine_args` declares the options for `jserve generate`, `serve`, `bench` and `sweep`
alike (each `--help` lists them all) and `engine_config_from_args` reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flax import nnx

from jserve.cache.prefix import CAPACITY_COUNTS, PrefixCacheConfig
from jserve.engine.view import SchedulerLimits
from jserve.policies import POLICIES, make_policy
from jserve.policies.tail_optimized_lru import EVICTION_RULES, ORACLE_RULES
from jserve.runners.hardware import HARDWARE, get_hardware, kv_capacity_blocks
from jserve.runners.sharding import sharded_config
from jserve.runners.engine_overhead import EngineOverhead
from jserve.runners.testbeds import (
    COST_MODELS,
    DEFAULT_COST_MODEL,
    DEFAULT_ENGINE_OVERHEAD,
    ENGINE_OVERHEADS,
    cost_model_info,
)
from jserve.models.config import ModelConfig
from jserve.models.loading import CausalLM, LoadedModel
from jserve.models.registry import DEFAULT_MODEL, MODELS, get_config

if TYPE_CHECKING:
    from jserve.engine.policy import Policy
    from jserve.predictor import LengthPredictor

Runner = Literal["real", "sim"]
RUNNERS: tuple[str, ...] = ("real", "sim")
WEIGHTS: tuple[str, ...] = ("auto", "real", "dummy")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
ATTENTION: tuple[str, ...] = ("auto", "reference", "pallas", "pallas-interpret")
MAX_DEFAULT_MODEL_LEN = 2048  # the default max_model_len: the model's context, at most this


@dataclass(frozen=True)
class EngineConfig:
    """How to build one engine; every field has the default `LLM(...)` and the CLI use.

    Model:
        model: a name from `jserve.models.registry`, a Hugging Face checkpoint directory
            (`jserve.models.hf_checkpoint`), or (real engine only) a model already in
            memory: a `LoadedModel`, so several engines can share one, or a Flax model of
            jserve's families (e.g. `PagedModel.bind(params)`, `jserve.models.functional`).
        weights: 'auto' (real where a package or the checkpoint has them, else random),
            'real' or 'dummy' (random, in the shape's or the checkpoint's config).
        dtype: 'auto' (float32 on CPU; on accelerators a checkpoint's own bfloat16 or
            float16, else bfloat16; bfloat16 in the simulator), or the dtype to convert to.
        seed: seed of random (dummy) weights.
    Scheduling:
        policy: a name in `jserve.policies.POLICIES` or a policy object
            (e.g. `SarathiPolicy(token_budget=256)`).
        predictor: output-length predictor for the policies that allocate by prediction
            (cacheopt, rlp, s3, layerkv): 'auto' loads the shipped one of the policy's kind
            when it reads this model's tokens, None gives no predictions (the policy then
            reserves each request's maximum), a directory `jserve train-predictor` wrote,
            or a `LengthPredictor`. Benchmarks draw predictions from the trace instead,
            from the noise model of the directory's run (`--predictions noise`).
        max_model_len: prompt + output cap; None: the model's context, at most 2048.
        max_num_seqs / max_num_batched_tokens: per-step limits (vLLM's meaning; None: a
            whole prompt fits one step and every running sequence can decode together).
    KV cache:
        block_size: tokens per KV block.
        num_blocks: KV blocks; None sizes the cache from memory (the device's on the real
            engine, the simulated accelerator's in the simulator). A test can force a tiny
            cache to provoke preemptions.
        gpu_memory_utilization: the share of device memory weights and KV may take.
        kv_cache_space: GiB of KV cache when num_blocks is not given (vLLM's CPU backend
            takes a fixed VLLM_CPU_KVCACHE_SPACE likewise); None: on CPU a quarter of the
            RAM, at most 2 GiB, on an accelerator gpu_memory_utilization's share.
        swap_space: GiB of host memory per device for the K/V of requests preempted by
            swapping (vLLM's option) and of layers a policy keeps on the host (LayerKV); 0
            leaves policies recompute preemption only. None: vLLM's default of 4 GiB, or for
            a policy that keeps layers on the host, sized from the host's memory
            (`jserve.builder.host_tier_bytes`).
        prefix_cache: keep finished requests' full KV blocks for prompts that start the
            same way: an eviction rule's name ('lru', 'threshold-lru', 'tlru'; see
            `jserve.policies.tail_optimized_lru`) or a `PrefixCacheConfig`. None: off.
    Runner:
        runner: 'real' (the model on this machine's device, wall clock) or 'sim' (the same
            engine loop charging each step from a cost model on a virtual clock).
        attention: 'auto' (Pallas kernels on GPU, jnp reference on CPU), 'reference',
            'pallas', or 'pallas-interpret' (the kernels interpreted, for checking).
        warmup: compile the step's shape buckets at start-up rather than on first use.
        background_compile: with warmup, compile only the buckets one short request needs
            before returning (`jax_runner.first_shapes`) and the rest on background threads
            (one per core, up to 4), smallest first; a step that meets a bucket not built yet
            builds it (or waits for it) first. Every bucket warm-up covers is compiled once
            they end. On by
            default in `jserve serve`, so the server answers early.
        async_scheduling: plan each step while the device computes the one before, reading
            its tokens a step late (vLLM's `--async-scheduling`; `jserve.engine.loop.Engine`).
            The tokens are the same; a request an EOS or stop string ends runs one step more.
            Used by the real runner without a prefix cache, layer offload or hidden cache.
        hardware: the accelerator the simulator models (`jserve.runners.hardware`); on the
            real engine only its host link is read, to price swaps for `profile`.
        cost_model: how the simulator prices a step's GPU work when no `profile` is given:
            'measured' (Vidur's A100 kernel profiles; the default), 'roofline' (ideal, for
            what-if questions), or a paper's testbed (its GPU and its stack;
            `jserve.runners.testbeds`).
        engine_overhead: the serving stack whose own time (CPU per step and per sequence,
            workers under tensor parallelism, eager launches or CUDA graphs) the simulator
            adds to the GPU's work: a shipped profile's name or an `EngineOverhead` of one's
            own (`jserve.runners.engine_overhead`); None: the cost model's own
            (`vllm-0.2.3-server` under 'measured', see `testbeds`).
        tensor_parallel_size: devices one model is split across, Megatron-style (attention
            heads and the MLP's inner dimension; the KV cache by KV head). The real engine
            needs that many JAX devices; the simulator prices the all-reduces over the
            hardware's interconnect.
        profile: a step-time profile from `jserve profile`: the simulator charges steps
            from it, and on either runner CacheOpt's swap-vs-recompute costs are fitted to
            it (the simulator fits them to its cost model when no profile is given; the
            real engine without one leaves the policy its fallback, always swap).
    """

    model: str | LoadedModel | CausalLM = DEFAULT_MODEL
    weights: Literal["auto", "real", "dummy"] = "auto"
    dtype: str = "auto"
    seed: int = 0
    policy: str | Policy = "vllm"
    predictor: str | os.PathLike[str] | None | LengthPredictor = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float | None = None
    swap_space: float | None = None
    prefix_cache: PrefixCacheConfig | None = None
    runner: Runner = "real"
    attention: str = "auto"
    warmup: bool = True
    background_compile: bool = False
    async_scheduling: bool = True
    hardware: str = "a100-80g"
    profile: str | None = None
    cost_model: str = DEFAULT_COST_MODEL
    engine_overhead: str | EngineOverhead | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.prefix_cache, str):  # a rule's name is shorthand for its defaults
            cache = None if self.prefix_cache == "none" else PrefixCacheConfig(self.prefix_cache)
            object.__setattr__(self, "prefix_cache", cache)
        _check_choice("runner", self.runner, RUNNERS)
        if isinstance(self.model, nnx.Module):
            object.__setattr__(self, "model", LoadedModel.of(self.model))
        if isinstance(self.model, str):
            get_config(self.model)  # unknown names fail with the known ones; a directory's config is read
        elif self.runner == "sim":
            raise ValueError("the simulator takes a model name from the registry, not a loaded model")
        if isinstance(self.policy, str):
            make_policy(self.policy)  # unknown names fail with the list of known ones
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("attention", self.attention, ATTENTION)
        _check_choice("hardware", self.hardware, tuple(sorted(HARDWARE)))
        _check_choice("cost_model", self.cost_model, COST_MODELS)
        if self.engine_overhead is not None:
            if isinstance(self.engine_overhead, str):
                _check_choice("engine_overhead", self.engine_overhead, ENGINE_OVERHEADS)
            if self.profile is not None:
                raise ValueError("a --profile measures jserve's own runner, its overhead included: "
                                 "pass --engine-overhead or --profile, not both")
        if self.runner == "sim" and self.profile is None:
            cost_model_info(self.cost_model).check_hardware(self.hardware)
            cost_model_info(self.cost_model).engine(self.engine_overhead)
        if isinstance(self.predictor, os.PathLike):
            object.__setattr__(self, "predictor", os.fspath(self.predictor))
        if self.predictor_dir is not None:
            from jserve.predictor.checkpoint import check_predictor_dir

            check_predictor_dir(self.predictor_dir, self.make_policy().capabilities.predictor_kind)
        if self.prefix_cache is not None and self.prefix_cache.eviction not in EVICTION_RULES:
            raise ValueError(f"unknown prefix-cache eviction rule {self.prefix_cache.eviction!r}; "
                             f"known rules: {', '.join(sorted(EVICTION_RULES))}")
        for name in ("block_size", "max_num_seqs"):
            _check_at_least(name, getattr(self, name), 1)
        for name in ("num_blocks", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_at_least(name, getattr(self, name), 1)
        _check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        sharded_config(self.model_config(), self.tensor_parallel_size)  # heads must split evenly
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.prefix_cache is not None and self.make_policy().capabilities.offloads_layers:
            raise ValueError(f"policy {self.policy_name!r} keeps some requests' layers on the host "
                             "(LayerKV), which splits blocks per layer; a prefix cache shares whole "
                             "blocks between requests: use one or the other")
        if self.kv_cache_space is not None and not self.kv_cache_space > 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.runner == "sim":  # the simulated TP group must hold the weights
            self.sim_kv_blocks()

    def sim_kv_blocks(self) -> int:
        """KV blocks the simulated accelerators hold (`num_blocks` when given), sized as
        vLLM sizes its cache for these limits."""
        if self.num_blocks is not None:
            return self.num_blocks
        limits = self.limits
        return kv_capacity_blocks(self.model_config(), get_hardware(self.hardware), self.block_size,
                                  self.sim_dtype_bytes, self.gpu_memory_utilization,
                                  self.tensor_parallel_size, limits.max_num_batched_tokens,
                                  limits.max_num_seqs)

    @property
    def sim_dtype_bytes(self) -> int:
        """Bytes per weight and K/V value in the simulator: bf16 unless a dtype is named."""
        return 4 if self.dtype == "float32" else 2

    @property
    def model_name(self) -> str:
        """The name the model is served and recorded under (a checkpoint's is its shape's
        registry name, else its directory's)."""
        return self.model_config().name

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.name

    def model_config(self) -> ModelConfig:
        """The model's shapes: the registry's, or the loaded model's own."""
        return get_config(self.model) if isinstance(self.model, str) else self.model.config

    @property
    def limits(self) -> SchedulerLimits:
        """The per-step limits every plan must respect, defaults resolved for the model."""
        max_model_len = self.max_model_len or min(self.model_config().max_position, MAX_DEFAULT_MODEL_LEN)
        return SchedulerLimits.with_default_budget(self.max_num_seqs, self.max_num_batched_tokens,
                                                   max_model_len)

    @property
    def predictor_dir(self) -> Path | None:
        """The trained predictor's directory `predictor` names; None for 'auto' (the shipped
        one), None or a predictor object."""
        if isinstance(self.predictor, str) and self.predictor != "auto":
            return Path(self.predictor)
        return None

    def make_policy(self) -> Policy:
        """A fresh policy of the configured name, or the configured policy object."""
        return make_policy(self.policy) if isinstance(self.policy, str) else self.policy

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for benchmark records: the model, policy and predictor by name, and
        the prefix cache's settings without an oracle's futures."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        cache = self.prefix_cache
        d.update(model=self.model_name, policy=self.policy_name,
                 engine_overhead=getattr(self.engine_overhead, "name", self.engine_overhead),
                 predictor=self.predictor if self.predictor is None or isinstance(self.predictor, str)
                 else type(self.predictor).__name__,
                 prefix_cache=None if cache is None else
                 {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache) if f.name != "futures"})
        return d


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


def _check_at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


# --------------------------------------------------------------------------- command line


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """`--model`, alone: for commands that load a model but build no serving engine."""
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_PATH",
                        help="a Hugging Face checkpoint directory (config.json, *.safetensors, "
                             "tokenizer.json), or a shape's name: "
                             f"{', '.join(sorted(MODELS))}; of those, only smollm2-135m has real "
                             "weights (default: %(default)s)")


def add_engine_args(parser: argparse.ArgumentParser, *, benchmark: bool = False,
                    policy: bool = True) -> None:
    """Every `EngineConfig` option, declared once for generate, serve, bench and sweep.

    `benchmark` (bench, sweep) adds `--engine` to pick the simulated runner, the prefix-cache
    rules that read a workload's future, and `--max-total-len` as the old name of
    `--max-model-len` (the trace's prompt + output cap too). `policy=False` leaves out
    `--policy` (sweep names several). A command whose default differs sets it with
    `parser.set_defaults` (generate starts without warm-up)."""
    d = EngineConfig()
    add_model_arg(parser)
    parser.add_argument("--weights", default=d.weights, choices=WEIGHTS,
                        help="auto: real weights where a package or the checkpoint has them, "
                             "else random (default: %(default)s)")
    parser.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                        help="auto: float32 on CPU, on accelerators a checkpoint's own half "
                             "precision or else bfloat16, bfloat16 in the simulator; otherwise the "
                             "dtype weights are converted to (default: %(default)s)")
    if policy:
        parser.add_argument("--policy", default=d.policy, choices=sorted(POLICIES),
                            help="scheduling / KV-cache policy (default: %(default)s)")
    parser.add_argument("--predictor", default=d.predictor, metavar="DIR",
                        help="output-length predictor of the prediction-based policies: a "
                             "directory `jserve train-predictor` wrote (the simulator and bench "
                             "draw from its noise.json) (default: the shipped one)")
    names = ["--max-model-len", "--max-total-len"] if benchmark else ["--max-model-len"]
    parser.add_argument(*names, dest="max_model_len", type=int, default=None, metavar="L",
                        help="prompt + output token cap" + (", of the engine and the trace"
                                                            if benchmark else "")
                             + f" (default: min(model context, {MAX_DEFAULT_MODEL_LEN}))")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                        help="sequences per step (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: max(max-model-len, 2048))")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV cache size in blocks (default: sized from free memory, or from "
                             "the simulated hardware)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of device memory weights and KV may take (default: %(default)s)")
    parser.add_argument("--kv-cache-space", type=float, default=None, metavar="GIB",
                        help="GiB of KV cache when --num-blocks is not given (default: on CPU a "
                             "quarter of RAM, at most 2 GiB; on accelerators "
                             "--gpu-memory-utilization's share)")
    parser.add_argument("--swap-space", type=float, default=d.swap_space, metavar="GIB",
                        help="GiB of host memory per device for K/V of requests preempted by "
                             "swapping and of layers kept on the host (default: 4; for a policy "
                             "that keeps layers on the host, LayerKV, sized from the host's memory)")
    _add_prefix_cache_args(parser, benchmark)
    parser.add_argument("--attention", default=d.attention, choices=ATTENTION,
                        help="attention backend; auto: Pallas kernels on GPU, jnp reference on CPU")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=d.warmup,
                        help="compile every step shape at start-up; --no-warmup starts at once "
                             "and compiles shapes on first use (default: %(default)s)")
    parser.add_argument("--background-compile", action=argparse.BooleanOptionalAction,
                        default=d.background_compile,
                        help="with --warmup, compile what a short request needs first and the "
                             "other shapes in the background (default: on for serve, off "
                             "otherwise)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=d.async_scheduling,
                        help="plan each step while the device runs the previous one (real runner; "
                             "off with a prefix cache, layer offload or hidden cache; default: "
                             "%(default)s)")
    if benchmark:
        parser.add_argument("--engine", dest="runner", choices=RUNNERS, default="sim",
                            help="real: run the model here; sim: same engine loop, steps charged "
                                 "from a cost model on a virtual clock (default: sim)")
    parser.add_argument("--hardware", default=d.hardware, choices=sorted(HARDWARE),
                        help="accelerator the simulator models; the real engine reads only its "
                             "host link, to price swaps for --profile (default: %(default)s)")
    parser.add_argument("--cost-model", default=d.cost_model, choices=COST_MODELS,
                        help="how the simulator prices a step's GPU work when no --profile is "
                             "given; a paper's testbed also fixes its GPU and stack "
                             "(default: %(default)s)")
    parser.add_argument("--engine-overhead", default=None, choices=ENGINE_OVERHEADS, metavar="NAME",
                        help="the serving stack whose own time the simulator adds to the GPU's "
                             f"work: {', '.join(ENGINE_OVERHEADS)} (default: the cost model's own, "
                             f"{DEFAULT_ENGINE_OVERHEAD} under measured)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        metavar="N",
                        help="devices the model is split across (attention heads, MLP, KV heads); "
                             "the simulator prices the all-reduces (default: %(default)s)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="step-time profile from `jserve profile`: the simulator charges "
                             "steps from it, and CacheOpt fits its swap-vs-recompute costs to it")


def _add_prefix_cache_args(parser: argparse.ArgumentParser, benchmark: bool) -> None:
    """Prefix-cache flags; `benchmark` adds the rules that need the workload's future."""
    rules = sorted(r for r in EVICTION_RULES if benchmark or r not in ORACLE_RULES)
    d = PrefixCacheConfig()
    parser.add_argument("--prefix-cache", default="none", choices=["none", *rules],
                        help="keep finished requests' KV blocks for prompts that start the same "
                             "way, evicting by this rule (default: none)"
                             + ("; end-aware-tlru, length-aware-tlru and tbelady read the "
                                "conversations' future (sharegpt-multiturn only)" if benchmark else ""))
    parser.add_argument("--cache-capacity", type=int, default=None, metavar="TOKENS",
                        help="most tokens of idle KV the prefix cache holds, trimmed after "
                             "each step (default: every block no request uses)")
    parser.add_argument("--cache-capacity-counts", choices=list(CAPACITY_COUNTS),
                        default=d.capacity_counts,
                        help="what --cache-capacity bounds: unreferenced (idle) blocks, the T-LRU "
                             "paper's reading, or all cached blocks, those running requests reuse "
                             "too (default: %(default)s)")
    parser.add_argument("--cache-isolation", action="store_true",
                        help="no prefix reuse across conversations (default: shared)")
    parser.add_argument("--host-cache-capacity", type=int, default=d.host_capacity_tokens,
                        metavar="TOKENS",
                        help="demote evicted prefix blocks to this much host memory and copy them "
                             "back on reuse (default: 0, off)")
    parser.add_argument("--tel-threshold", type=float, default=d.tel_threshold, metavar="SECONDS",
                        help="T-LRU's xi: the TTFT a turn may take before it counts as tail excess "
                             "latency (default: %(default)s)")
    parser.add_argument("--tlru-xi-tokens", type=float, default=d.xi_tokens, metavar="TOKENS",
                        help="T-LRU's xi in tokens, as the authors' vLLM and SGLang ports take it "
                             "(default: --tel-threshold over a prefill-time line fitted once to "
                             "the simulator's cost model or the --profile)")
    parser.add_argument("--tlru-q-hat", type=float, default=d.q_hat, metavar="TOKENS",
                        help="T-LRU's next-message estimate Q_hat (default: %(default)s, the "
                             "paper's ShareGPT value)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the options of `add_engine_args` describe."""
    cache = None if args.prefix_cache == "none" else PrefixCacheConfig(
        args.prefix_cache, args.cache_capacity, args.cache_isolation, args.tel_threshold,
        args.host_cache_capacity, q_hat=args.tlru_q_hat, xi_tokens=args.tlru_xi_tokens,
        capacity_counts=args.cache_capacity_counts)
    return EngineConfig(
        model=args.model, weights=args.weights, dtype=args.dtype,
        policy=getattr(args, "policy", EngineConfig.policy), predictor=args.predictor,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_space=args.kv_cache_space,
        swap_space=args.swap_space, prefix_cache=cache, runner=getattr(args, "runner", "real"),
        attention=args.attention, warmup=args.warmup,
        background_compile=args.background_compile, async_scheduling=args.async_scheduling,
        hardware=args.hardware, profile=args.profile,
        cost_model=args.cost_model, engine_overhead=args.engine_overhead,
        tensor_parallel_size=args.tensor_parallel_size,
    )


# --------------------------------------------------------------------------- the HTTP server


API_KEY_ENV = "JSERVE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """How `jserve serve` listens and what it refuses before a request reaches the engine.

    host / port: where to listen (the port is bound before the model loads).
    api_key: every /v1 route then needs `Authorization: Bearer KEY` (401 otherwise);
        /health and /metrics stay open. None: no authentication.
    max_request_bytes: larger bodies get 413 before they are parsed or tokenized.
    max_waiting_requests: new requests get 503 with Retry-After while this many wait for
        the engine (never started or preempted); None: no limit.
    drain_s: on SIGINT/SIGTERM, how long running requests may go on finishing before the
        rest are aborted.
    served_model_names: the names clients may ask for in `model` (vLLM's
        --served-model-name; a Hugging Face id such as `HuggingFaceTB/SmolLM2-135M-Instruct`
        lets a client that looks its tokenizer up by the model's name find it); the first is
        the one `/health` reports. Empty: the model's registry name.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 4 * 2**20
    max_waiting_requests: int | None = None
    drain_s: float = 5.0
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("a served model name must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (omit it to serve without one)")
        _check_at_least("max_request_bytes", self.max_request_bytes, 1)
        if self.max_waiting_requests is not None:
            _check_at_least("max_waiting_requests", self.max_waiting_requests, 1)
        if not self.drain_s >= 0:
            raise ValueError(f"drain_s must be >= 0 seconds, got {self.drain_s}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """`ServerConfig`'s options, for `jserve serve`."""
    d = ServerConfig()
    parser.add_argument("--host", default=d.host, help="interface to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port (default: %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every /v1 route (default: "
                             f"${API_KEY_ENV} if set, else none)")
    parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, metavar="N",
                        help="refuse larger request bodies with 413 (default: %(default)s)")
    parser.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                        help="answer 503 with Retry-After while N requests wait (default: no limit)")
    parser.add_argument("--drain-timeout", dest="drain_s", type=float, default=d.drain_s,
                        metavar="SECONDS",
                        help="on Ctrl-C / SIGTERM, let running requests finish this long, then "
                             "abort the rest (default: %(default)s)")
    parser.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=[],
                        metavar="NAME",
                        help="the names clients may send as `model` (several allowed; a Hugging "
                             "Face id lets clients find the tokenizer by name); the first is the "
                             "one /health reports (default: the --model name)")


def server_config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> ServerConfig:
    """The `ServerConfig` of `add_server_args`' options; the API key falls back to
    `$JSERVE_API_KEY` (kept out of the process list and shell history)."""
    return ServerConfig(host=args.host, port=args.port,
                        api_key=args.api_key or environ.get(API_KEY_ENV) or None,
                        max_request_bytes=args.max_request_bytes,
                        max_waiting_requests=args.max_waiting_requests, drain_s=args.drain_s,
                        served_model_names=tuple(args.served_model_names))
