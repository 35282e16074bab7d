"""Fits of the simulator's measured kernels and engine-overhead profiles to published
measurements (their figures only, each source named beside its number in the shipped
`jserve/runners/data/published_a100.json`), each a least-squares fit of relative error that
returns its residuals. Which measurement fits which term: docs/simulator.md, The published fits.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jserve.benchmarking.published_runs import PublishedRun
from jserve.runners.cost_model import StepShape, nnls
from jserve.runners.hardware import Hardware, get_hardware
from jserve.runners.engine_overhead import FLAT_2MS, KERNELS_ONLY, EngineOverhead, FitRange
from jserve.runners.measured_cost import KernelFit, MeasuredCostModel, PublishedFit, elementwise_bytes
from jserve.models.config import ModelConfig
from jserve.models.registry import get_config

# Every profile here ran on an A100-SXM4-80GB in fp16.
PROFILED_ON = "a100-80g"
DTYPE_BYTES = 2
VIDUR_CPU_MODEL = "meta-llama/Llama-2-7b-hf"


@dataclass(frozen=True)
class Residuals:
    """How well one fit reproduces its measurements: relative errors (model / measured - 1)."""

    name: str
    num_samples: int
    rms: float
    max_abs: float
    p90_abs: float

    @classmethod
    def of(cls, name: str, predicted: np.ndarray, measured: np.ndarray) -> Residuals:
        err = np.asarray(predicted) / np.asarray(measured) - 1.0
        return cls(name, len(err), float(np.sqrt(np.mean(err**2))), float(np.abs(err).max()),
                   float(np.percentile(np.abs(err), 90)))


@dataclass(frozen=True)
class Fit:
    """A fitted term: its parameters by name and its residuals."""

    params: dict[str, float]
    residuals: Residuals


def read_profile_csv(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _relative_fit(model: Callable[[np.ndarray], np.ndarray], measured: np.ndarray,
                  start: Sequence[float], lower: Sequence[float], upper: Sequence[float]) -> np.ndarray:
    from scipy.optimize import least_squares  # a dependency of jax, needed only to refit

    result = least_squares(lambda p: model(p) / measured - 1.0, np.asarray(start, float),
                           bounds=(np.asarray(lower, float), np.asarray(upper, float)))
    return result.x


# ------------------------------------------------------------------------------- kernels


def fit_gemms(rows: list[dict[str, str]], hw: Hardware) -> Fit:
    """Linear layers: `launch + max(bytes / (HBM * weight_mbu), flops / (peak * gemm_mfu))`,
    bytes being the weight and the input and output activations, over Llama-2-7B's four
    projections at every token count and TP degree profiled."""
    m, k, n, t = [], [], [], []
    for r in rows:
        tp, d = int(r["num_tensor_parallel_workers"]), int(r["n_embd"])
        heads, kv, ffn = int(r["n_head"]), int(r["n_kv_head"]), int(r["n_expanded_embd"])
        hd = d // heads
        gated = 2 if r["use_gated_mlp"] == "True" else 1
        shapes = {"attn_pre_proj": (d, (heads + 2 * kv) * hd // tp), "attn_post_proj": (heads * hd // tp, d),
                  "mlp_up_proj": (d, gated * ffn // tp), "mlp_down_proj": (ffn // tp, d)}
        for op, (kk, nn) in shapes.items():
            m.append(int(r["num_tokens"]))
            k.append(kk)
            n.append(nn)
            t.append(float(r[f"time_stats.{op}.median"]) * 1e-3)
    m, k, n, t = (np.asarray(x, float) for x in (m, k, n, t))
    mem = (k * n + m * (k + n)) * DTYPE_BYTES / hw.hbm_bandwidth
    flops = 2 * m * k * n / hw.peak_flops

    def model(p: np.ndarray) -> np.ndarray:
        return p[0] * 1e-6 + np.maximum(mem / p[1], flops / p[2])

    p = _relative_fit(model, t, [5, 0.8, 0.7], [0, 0.05, 0.05], [100, 1, 1])
    return Fit({"gemm_launch": p[0] * 1e-6, "weight_mbu": p[1], "gemm_mfu": p[2]},
               Residuals.of("linear layers (Vidur, Llama-2-7B, TP 1-8)", model(p), t))


ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add", "add")


def fit_elementwise(rows: list[dict[str, str]], hw: Hardware) -> Fit:
    """A layer's element-wise kernels (two norms, rotary embedding, activation, two residual
    adds) as `launch + tokens * elementwise_bytes / (HBM * mbu)`, at TP 1: memory-bound
    work, so on another GPU it scales by that GPU's bandwidth."""
    rows = [r for r in rows if r["num_tensor_parallel_workers"] == "1"]
    cfg = get_config("llama-2-7b")
    if any(int(r["n_embd"]) != cfg.hidden_size for r in rows):
        raise ValueError("the element-wise profile is not of Llama-2-7B's shape")
    seconds_per_token = elementwise_bytes(cfg, 1, DTYPE_BYTES) / hw.hbm_bandwidth
    x = np.array([int(r["num_tokens"]) for r in rows], float) * seconds_per_token
    t = np.array([sum(float(r[f"time_stats.{op}.median"]) for op in ELEMENTWISE_OPS) * 1e-3 for r in rows])

    def model(p: np.ndarray) -> np.ndarray:
        return p[0] * 1e-6 + x / p[1]

    p = _relative_fit(model, t, [20, 0.5], [0, 0.01], [1000, 1])
    return Fit({"elementwise_launch": p[0] * 1e-6, "elementwise_mbu": p[1]},
               Residuals.of("element-wise ops per layer (Vidur, Llama-2-7B, TP 1)", model(p), t))


def _attention_heads(row: dict[str, str]) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) on one GPU of the profiled shape."""
    tp = int(row["num_tensor_parallel_workers"])
    heads, kv = int(row["n_q_head"]), int(row["n_kv_head"])
    return heads // tp, max(kv // tp, 1), int(row["n_embd"]) // heads


def fit_prefill_attention(rows: list[dict[str, str]], hw: Hardware) -> Fit:
    """FlashAttention over a prefill chunk of q tokens after s cached ones:
    `launch + f*q*q / (peak * square_mfu) + f*q*s / (peak * prefix_mfu)`, f = 4 * heads *
    head_dim FLOPs per (query, key) pair. The q*q term is priced against the whole square:
    the chunk's causal half runs at about half that rate, as measured."""
    rows = [r for r in rows if r["is_prefill"] == "True"]
    q = np.array([int(r["prefill_chunk_size"]) for r in rows], float)
    s = np.array([int(r["kv_cache_size"]) for r in rows], float)
    t = np.array([float(r["time_stats.attn_prefill.median"]) * 1e-3 for r in rows])
    heads, _, hd = _attention_heads(rows[0])
    f = 4.0 * heads * hd / hw.peak_flops

    def model(p: np.ndarray) -> np.ndarray:
        return p[0] * 1e-6 + f * q * q / p[1] + f * q * s / p[2]

    p = _relative_fit(model, t, [10, 0.3, 0.6], [0, 0.01, 0.01], [1000, 1, 1])
    return Fit({"prefill_launch": p[0] * 1e-6, "prefill_square_mfu": p[1], "prefill_prefix_mfu": p[2]},
               Residuals.of("prefill attention (Vidur, FlashAttention)", model(p), t))


def fit_decode_attention(rows: list[dict[str, str]], hw: Hardware) -> Fit:
    """Paged decode attention of a batch: `launch + K/V bytes / (HBM * kv_mbu)`."""
    rows = [r for r in rows if r["is_prefill"] == "False"]
    _, kv_heads, hd = _attention_heads(rows[0])
    tokens = np.array([int(r["batch_size"]) * int(r["kv_cache_size"]) for r in rows], float)
    t = np.array([float(r["time_stats.attn_decode.median"]) * 1e-3 for r in rows])
    seconds_per_token = 2.0 * kv_heads * hd * DTYPE_BYTES / hw.hbm_bandwidth

    def model(p: np.ndarray) -> np.ndarray:
        return p[0] * 1e-6 + tokens * seconds_per_token / p[1]

    p = _relative_fit(model, t, [10, 0.7], [0, 0.05], [1000, 1])
    return Fit({"decode_launch": p[0] * 1e-6, "kv_mbu": p[1]},
               Residuals.of("paged decode attention (Vidur)", model(p), t))


def kernel_fit_range(mlp: list[dict[str, str]], attention: list[dict[str, str]]) -> FitRange:
    """What Vidur's kernel profiles covered: tokens a step, decode batch, context, TP."""
    decodes = [r for r in attention if r["is_prefill"] == "False"]
    return FitRange(max_batch=max(int(r["batch_size"]) for r in decodes),
                    max_context=max(int(r["kv_cache_size"]) + int(r["prefill_chunk_size"] or 0) for r in attention),
                    max_tokens=max(int(r["num_tokens"]) for r in mlp),
                    tensor_parallel=tuple(sorted({int(r["num_tensor_parallel_workers"]) for r in mlp})))


def fit_kernels(folder: pathlib.Path) -> tuple[KernelFit, list[Fit]]:
    """Every kernel term from Vidur's profiles in `folder`."""
    hw = get_hardware(PROFILED_ON)
    mlp = read_profile_csv(folder / "llama-2-7b_mlp.csv")
    attention = read_profile_csv(folder / "attention.csv")
    fits = [fit_gemms(mlp, hw), fit_elementwise(mlp, hw), fit_prefill_attention(attention, hw),
            fit_decode_attention(attention, hw)]
    params = {k: v for fit in fits for k, v in fit.params.items()}
    return KernelFit(**params, fit_range=kernel_fit_range(mlp, attention)), fits


# ------------------------------------------------------------------------------- stacks

CPU_PHASES = ("schedule", "prepare_inputs_e2e", "sampler_e2e", "process_model_outputs")
# vLLM PR #1440 (CUDA graphs for Llama, 2023-10): Llama-2-7B on one GPU, 5 prompt and 100
# output tokens at batch 1, about 1.2 s eager against 1.05 s with a graph per batch size.
PR1440_EAGER_S, PR1440_GRAPH_S, PR1440_TOKENS = 1.2, 1.05, 100
# vLLM's blog "vLLM v0.6.0: 2.7x Throughput Improvement" (2024-09-05), profiling v0.5.3
# serving Llama 3 8B on one H100: the HTTP API server took 33% of the time and scheduling
# (gathering the last step's results, scheduling and preparing the next) 29%.
V053_API_SERVER_SHARE, V053_SCHEDULING_SHARE = 0.33, 0.29
# vLLM 0.4-0.5 capture CUDA graphs of decode batches up to 256 sequences
# (`_BATCH_SIZES_TO_CAPTURE`: 1, 2, 4 and multiples of 8 to 256).
VLLM_GRAPH_MAX_BATCH = 256


def _cpu_rows(rows: list[dict[str, str]], model_name: str, tp: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vidur's CPU profile of one model at one TP degree: batch sizes, the CPU phases' sum
    and the time the driver spent talking to its Ray workers, in seconds."""
    rows = [r for r in rows if r["model_name"] == model_name and r["tensor_parallel_degree"] == tp]
    b = np.array([int(r["batch_size"]) for r in rows], float)
    t = np.array([sum(float(r[f"{phase}_median"]) for phase in CPU_PHASES) * 1e-3 for r in rows])
    ray = np.array([float(r["ray_comm_time_mean"]) * 1e-3 for r in rows])
    return b, t, ray


def fit_cpu_overhead(rows: list[dict[str, str]], model_name: str = VIDUR_CPU_MODEL) -> Fit:
    """vLLM's CPU time per step outside the model's kernels (schedule, prepare inputs,
    sampling, process outputs), `step + per_seq * batch`, ordinary least squares of
    relative error."""
    b, t, _ = _cpu_rows(rows, model_name, "1")
    x = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    step, per_seq = np.linalg.lstsq(x, np.ones_like(t), rcond=None)[0]
    predicted = step + per_seq * b
    return Fit({"step": float(step), "per_seq": float(per_seq)},
               Residuals.of(f"CPU time per step (Vidur, {model_name.split('/')[-1]}, TP 1)", predicted, t))


def fit_vidur_workers(rows: list[dict[str, str]], model_name: str = VIDUR_CPU_MODEL) -> Fit:
    """What a tensor-parallel group's Ray workers add to a step: over every model Vidur
    profiled at TP > 1, its CPU phases plus its driver's Ray communication, less those of
    the TP 1 model at the same batch size, averaged (flat in batch: the residuals say how
    flat)."""
    b1, t1, ray1 = _cpu_rows(rows, model_name, "1")
    solo = dict(zip(b1, t1 + ray1))
    extra, labels = [], []
    for name, tp in sorted({(r["model_name"], r["tensor_parallel_degree"]) for r in rows if r["tensor_parallel_degree"] != "1"}):
        b, t, ray = _cpu_rows(rows, name, tp)
        extra += [tt + rr - solo[bb] for bb, tt, rr in zip(b, t, ray) if bb in solo]
        labels.append(f"{name.split('/')[-1]} TP {tp}")
    extra = np.array(extra)
    worker = float(extra.mean())
    return Fit({"worker_step": worker}, Residuals.of(f"Ray workers per step (Vidur, {'; '.join(labels)})",
                                                     np.full_like(extra, worker), extra))


def eager_launch_from_pr1440(kernels: KernelFit) -> float:
    """The GPU's idle time per eagerly launched kernel: PR #1440's eager-minus-graph time
    per decode step, over the kernels a Llama-2-7B decode step launches."""
    bare = MeasuredCostModel(get_config("llama-2-7b"), get_hardware(PROFILED_ON), kernels=kernels,
                             engine=KERNELS_ONLY)
    per_step = (PR1440_EAGER_S - PR1440_GRAPH_S) / PR1440_TOKENS
    return per_step / bare.kernel_launches(StepShape.decode([55]))


# ------------------------------------------------------------------------------- DistServe


@dataclass(frozen=True)
class StepLines:
    """DistServe's fit of one (model, TP) of vLLM 0.2.3 run offline, in ms: a prefill step
    `a + b * prompt tokens + c * sum of squared prompt lengths`, a decode step `a + b *
    context tokens read + c * batch`, one line below `threshold` sequences and one above."""

    prefill: tuple[float, float, float]
    small: tuple[float, float, float]
    large: tuple[float, float, float]
    threshold: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepLines:
        return cls(tuple(d["prefill"]), tuple(d["decoding_smallbs"]), tuple(d["decoding_largebs"]),
                   int(d["decoding_large_small_bs_threshold"]))

    def step_ms(self, shape: StepShape) -> float:
        if shape.num_prefill_tokens:
            a, b, c = self.prefill
            return a + b * shape.num_prefill_tokens + c * shape.prefill_square
        a, b, c = self.small if shape.num_seqs < self.threshold else self.large
        return a + b * shape.decode_context + c * shape.num_seqs


# As quoted in ../shared/calibration/README.md (OPT-13B, TP 1).
DISTSERVE_OPT13B_TP1 = StepLines((22.05, 0.14051, 8.0766e-6), (23.475, 0.00059293, 0.060727),
                                 (20.206, 0.00049077, 0.12000), 95)


def read_distserve_profile(path: pathlib.Path) -> dict[tuple[str, int], StepLines]:
    """DistServe's vLLM 0.2.3 profile by (model, TP) (`bench/data/` keeps a copy with its
    source)."""
    d = json.loads(path.read_text())
    return {(model, int(tp)): StepLines.from_dict(v) for model, tps in d["models"].items() for tp, v in tps.items()}


def distserve_vllm_step_ms(shape: StepShape) -> float:
    """DistServe's fit of vLLM 0.2.3's step time for OPT-13B on one A100-80GB."""
    return DISTSERVE_OPT13B_TP1.step_ms(shape)


def _steps_only(shapes: Sequence[StepShape]) -> list[StepShape]:
    """Steps vLLM 0.2.3 runs: busy, and never prefills beside decodes."""
    return [s for s in shapes if s.num_tokens and not (s.num_prefill_tokens and s.num_decode_tokens)]


def fit_engine_overhead(kernels: KernelFit, shapes: Sequence[StepShape], engine: EngineOverhead,
                        lines: StepLines = DISTSERVE_OPT13B_TP1,
                        model: ModelConfig | None = None) -> tuple[EngineOverhead, Fit]:
    """What vLLM 0.2.3 run offline adds to the measured kernels: DistServe's step times on
    `shapes` (the steps a replay of real traffic runs) as `gpu_slowdown * kernels + eager
    launches + step + per_seq * seqs`, least squares of relative error, the launches as
    `engine` has them; `engine`'s other terms are replaced by the fit."""
    model = model or get_config("opt-13b")
    hw = get_hardware(PROFILED_ON)
    shapes = _steps_only(shapes)
    bare = MeasuredCostModel(model, hw, kernels=kernels, engine=dataclasses.replace(engine, step=0.0, per_seq=0.0))
    gpu = np.array([bare.kernel_time(s) for s in shapes])
    launches = np.array([bare.launch_time(s) for s in shapes])
    seqs = np.array([s.num_seqs for s in shapes], float)
    t = np.array([lines.step_ms(s) * 1e-3 for s in shapes])
    prefill = np.array([s.num_prefill_tokens > 0 for s in shapes])
    # Prefill and decode steps weigh the same in all, however many of each the grid has;
    # no term may be negative (`nnls`).
    weight = np.where(prefill, 1.0 / prefill.sum(), 1.0 / (~prefill).sum()) ** 0.5 / t
    x = np.stack([gpu, np.ones_like(gpu), seqs], axis=1)
    slowdown, step, per_seq = nnls(x * weight[:, None], (t - launches) * weight)
    fitted = dataclasses.replace(engine, step=float(step), per_seq=float(per_seq), gpu_slowdown=float(slowdown),
                                 fit_range=FitRange(max_batch=int(seqs.max())))
    predicted = np.array([MeasuredCostModel(model, hw, kernels=kernels, engine=fitted).step_time(s) for s in shapes])
    params = {"gpu_slowdown": fitted.gpu_slowdown, "step": fitted.step, "per_seq": fitted.per_seq}
    fit = Fit(params, Residuals.of(f"{engine.name}: DistServe's vLLM 0.2.3 step times, {model.name} TP 1 "
                                   f"({int(prefill.sum())} prefill, {int((~prefill).sum())} decode steps)",
                                   predicted, t))
    return fitted, fit


def _profile_errors(kernels: KernelFit, engine: EngineOverhead, shapes: Sequence[StepShape],
                    lines: StepLines, model: ModelConfig, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """Our step times of `shapes` for `model` at TP `tp` under `engine`, and DistServe's."""
    cost = MeasuredCostModel(model, get_hardware(PROFILED_ON), tensor_parallel=tp, kernels=kernels, engine=engine)
    shapes = _steps_only(shapes)
    return (np.array([cost.step_time(s) for s in shapes]), np.array([lines.step_ms(s) * 1e-3 for s in shapes]))


def fit_worker_step(kernels: KernelFit, engine: EngineOverhead, shapes: Sequence[StepShape],
                    lines: StepLines, model: ModelConfig, tp: int) -> tuple[EngineOverhead, Fit]:
    """The per-step cost of `engine`'s workers at TP `tp`: what DistServe's step times of
    `model` there add to ours without it, least squares of relative error."""
    ours, t = _profile_errors(kernels, dataclasses.replace(engine, worker_step=0.0), shapes, lines, model, tp)
    worker = max(float(((t - ours) / t**2).sum() / (1 / t**2).sum()), 0.0)
    fitted = dataclasses.replace(engine, worker_step=worker, worker_range=FitRange(tensor_parallel=(tp,)))
    return fitted, Fit({"worker_step": worker}, Residuals.of(
        f"{engine.name}: DistServe's vLLM 0.2.3 step times, {model.name} TP {tp}", ours + worker, t))


def profile_residuals(kernels: KernelFit, engine: EngineOverhead, shapes: Sequence[StepShape],
                      lines: StepLines, model: ModelConfig, tp: int) -> Residuals:
    """How well `engine` predicts DistServe's step times of `model` at TP `tp` (held out)."""
    ours, t = _profile_errors(kernels, engine, shapes, lines, model, tp)
    return Residuals.of(f"{engine.name}: DistServe's vLLM 0.2.3 step times, {model.name} TP {tp} (held out)",
                        ours, t)


def _window_features(run: PublishedRun, kernels: MeasuredCostModel, min_output: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request of `run` that decoded at least `min_output` tokens: the time from its
    first to its last token, and what vLLM ran meanwhile as `(kernel seconds, steps,
    sequence-steps, launch seconds)`. vLLM 0.2.3 never mixes prefills and decodes, so that
    window holds the request's `output - 1` decode steps, priced as the average batch it
    decoded in (the requests decoding beside it, and their average context), and the
    prefill step of every request whose first token came inside it."""
    arrival = np.array([r.arrival_time for r in run.trace.requests])
    prompt = np.array([r.prompt_len for r in run.trace.requests])
    output = np.array([r.output_len for r in run.trace.requests])
    first = arrival + run.ttft
    last = first + np.nan_to_num(run.tpot) * (output - 1)
    rows, seconds = [], []
    for i in np.flatnonzero(output >= min_output):
        start, end = first[i], last[i]
        overlap = np.clip(np.minimum(last, end) - np.maximum(first, start), 0.0, None)
        batch = overlap.sum() / (end - start)
        # each neighbour's context halfway through the overlap
        midpoint = (np.minimum(last, end) + np.maximum(first, start)) / 2
        done = np.clip((midpoint - first) / np.maximum(last - first, 1e-9), 0.0, 1.0)
        context = (overlap * (prompt + done * output)).sum() / overlap.sum()
        width = max(int(round(batch)), 1)
        steps = output[i] - 1
        prefills = np.flatnonzero((first > start) & (first < end))
        decode = StepShape.decode(np.full(width, round(context)))
        shapes = [StepShape.prefill(int(prompt[j])) for j in prefills]
        gpu = steps * kernels.kernel_time(decode) + sum(kernels.kernel_time(s) for s in shapes)
        launches = steps * kernels.launch_time(decode) + sum(kernels.launch_time(s) for s in shapes)
        rows.append([gpu, steps + len(prefills), steps * batch + len(prefills), launches])
        seconds.append(end - start)
    return np.array(rows), np.array(seconds)


def most_decoding(run: PublishedRun) -> int:
    """The most requests a real run had between their first and last token at once."""
    first = np.array([r.arrival_time for r in run.trace.requests]) + run.ttft
    last = first + np.nan_to_num(run.tpot) * (np.array([r.output_len for r in run.trace.requests]) - 1)
    events = sorted([(t, 1) for t in first] + [(t, -1) for t in last])
    return int(np.cumsum([step for _, step in events]).max())


def _window_model(engine: EngineOverhead, kernels: KernelFit, run_model: ModelConfig | None) -> MeasuredCostModel:
    return MeasuredCostModel(run_model or get_config("opt-13b"), get_hardware(PROFILED_ON), kernels=kernels,
                             engine=dataclasses.replace(engine, step=0.0, per_seq=0.0, gpu_slowdown=1.0))


def fit_engine_to_runs(kernels: KernelFit, runs: Sequence[PublishedRun], engine: EngineOverhead,
                       model: ModelConfig | None = None, min_output: int = 8) -> tuple[EngineOverhead, Fit]:
    """An engine's overhead fitted to real runs (`gpu_slowdown * kernels + eager launches +
    step + per_seq * sequences`, per step): each request's decoding window
    (`_window_features`) as measured, least squares of relative error, no term negative;
    the launches as `engine` has them."""
    features = [_window_features(run, _window_model(engine, kernels, model), min_output) for run in runs]
    x = np.concatenate([f[0] for f in features])
    t = np.concatenate([f[1] for f in features])
    slowdown, step, per_seq = nnls(x[:, :3] / t[:, None], 1.0 - x[:, 3] / t)
    fitted = dataclasses.replace(engine, step=float(step), per_seq=float(per_seq), gpu_slowdown=float(slowdown),
                                 fit_range=FitRange(max_batch=max(most_decoding(run) for run in runs)))
    rates = ", ".join(f"{run.rate:g}" for run in runs)
    fit = Fit({"gpu_slowdown": fitted.gpu_slowdown, "step": fitted.step, "per_seq": fitted.per_seq},
              Residuals.of(f"{engine.name}: decode windows of the real runs at {rates} req/s",
                           x[:, :3] @ np.array([slowdown, step, per_seq]) + x[:, 3], t))
    return fitted, fit


def run_residuals(engine: EngineOverhead, kernels: KernelFit, run: PublishedRun,
                  model: ModelConfig | None = None, min_output: int = 8) -> Residuals:
    """How well `engine` predicts the decoding windows of a run it was not fitted to."""
    x, t = _window_features(run, _window_model(engine, kernels, model), min_output)
    return Residuals.of(f"{engine.name}: decode windows at {run.rate:g} req/s (held out)",
                        x[:, :3] @ np.array([engine.gpu_slowdown, engine.step, engine.per_seq]) + x[:, 3], t)


def replay_step_shapes(prompts: Sequence[int], outputs: Sequence[int], *, max_batch: int = 256,
                       max_tokens: int = 2048, kv_tokens: int = 66_144, draws: int = 4,
                       seed: int = 0) -> list[StepShape]:
    """The steps a vLLM replay of requests of these lengths runs, for fitting an engine's
    overhead where serving lives: each prompt's prefill alone and twice in one step if that
    fits the token budget (equal lengths, as DistServe profiled prefill batches), and `draws`
    decode batches of each size from 1 to `max_batch`, of requests drawn from the trace at
    uniform points of their outputs, within the KV capacity."""
    rng = np.random.default_rng(seed)
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    shapes = [StepShape.prefill(int(p)) for p in prompts]
    shapes += [StepShape.from_lens([0, 0], [p, p]) for p in prompts if 2 * p <= max_tokens]
    for batch in np.repeat(np.arange(1, max_batch + 1), draws):
        picks = rng.integers(0, len(prompts), batch)
        context = prompts[picks] + np.ceil(rng.random(batch) * outputs[picks]).astype(int)
        if context.sum() <= kv_tokens:
            shapes.append(StepShape.decode(context))
    return shapes


def fit_jserve_overhead(path: pathlib.Path, policy: str = "vllm") -> tuple[EngineOverhead, Fit]:
    """jserve's own host work per step, `step + per_seq * running`, fitted (least squares of
    relative error) to `bench/engine_overhead.py`'s timing of `policy`'s steps."""
    d = json.loads(path.read_text())
    sizes = d["seconds_per_step"][policy]
    b = np.array([int(n) for n in sizes], float)
    t = np.array([v["engine+policy"] for v in sizes.values()])
    x = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    step, per_seq = np.linalg.lstsq(x, np.ones_like(t), rcond=None)[0]
    engine = EngineOverhead(
        "jserve", f"bench/engine_overhead.py ({d['date']}, {d['machine']}): the {policy} policy's steps "
        f"(snapshot, schedule, apply, batch, commit) of {d['model']} at {', '.join(sizes)} running requests, "
        "the simulated path (no token inputs built; the JAX runner's input building is not in it); "
        "a step is one compiled program (no per-kernel launches) and tensor parallelism one SPMD program "
        "(no workers to drive)", step=float(step), per_seq=float(per_seq),
        fit_range=FitRange(max_batch=int(b.max())))
    return engine, Fit({"step": engine.step, "per_seq": engine.per_seq},
                       Residuals.of("jserve: bench/engine_overhead.py", step + per_seq * b, t))


DISTSERVE_RUNS = ("DistServe (LLMServe/DistServe, Apache-2.0, commit 20a1633): "
                  "simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/vllm-N-R.exp, real "
                  "vLLM 0.2.3 API-server runs (--engine-use-ray --worker-use-ray) of OPT-13B on one "
                  "A100-SXM4-80GB (ShareGPT, Poisson)")
EAGER_SOURCE = ("eager launches: vLLM PR #1440 (Llama-2-7B, batch 1, 100 tokens: 1.2 s eager, 1.05 s with "
                "CUDA graphs) over the kernels a Llama-2-7B decode step launches")
# The real runs the online engine is fitted to; the others are held out.
CALIBRATED_RATES = (1.0, 3.0)
# DistServe's offline profile: the (model, TP) `worker_step` is fitted to; the rest are held out.
WORKER_FIT_AT = ("opt-13b", 2)


def fit_all(calibration: pathlib.Path, distserve_profile: pathlib.Path,
            jserve_overhead: pathlib.Path) -> tuple[PublishedFit, list[Fit | Residuals]]:
    """Every kernel term and engine-overhead profile, and the residuals of each fit and of
    each held-out comparison."""
    from jserve.benchmarking.published_runs import read_distserve_runs

    vidur = calibration / "vidur-a100"
    kernels, fits = fit_kernels(vidur)
    launch = eager_launch_from_pr1440(kernels)
    cpu_rows = read_profile_csv(vidur / "cpu_overheads.csv")
    cpu, workers = fit_cpu_overhead(cpu_rows), fit_vidur_workers(cpu_rows)
    tp_degrees = tuple(sorted({int(r["tensor_parallel_degree"]) for r in cpu_rows} - {1}))
    v04 = EngineOverhead(
        "vllm-0.4-offline", "Vidur data/profiling/a100/cpu_overheads.csv (a vLLM of early 2024 with Ray "
        "workers): Llama-2-7b-hf at TP 1, schedule + prepare inputs + sampler + process outputs (medians) "
        "-> step, per_seq; every model at TP > 1, the phases and the driver's Ray communication beyond "
        f"TP 1's -> worker_step; CUDA graphs of decodes to batch {VLLM_GRAPH_MAX_BATCH} (vLLM 0.4's "
        f"captured sizes); {EAGER_SOURCE}; kernels as Vidur profiled them. Checked against vLLM PR #5046's "
        "offline ShareGPT throughput (bench/sim_vs_real.py), not fitted to it",
        step=cpu.params["step"], per_seq=cpu.params["per_seq"], worker_step=workers.params["worker_step"],
        eager_launch=launch, cuda_graph_max_batch=VLLM_GRAPH_MAX_BATCH,
        fit_range=FitRange(max_batch=int(max(int(r["batch_size"]) for r in cpu_rows))),
        worker_range=FitRange(tensor_parallel=tp_degrees))
    server = (V053_API_SERVER_SHARE + V053_SCHEDULING_SHARE) / V053_SCHEDULING_SHARE
    v05 = dataclasses.replace(
        v04, name="vllm-0.5-server", step=v04.step * server, per_seq=v04.per_seq * server, estimate=True,
        source=f"an estimate: vllm-0.4-offline's CPU time per step and per sequence times {server:.2f}, the "
        f"API server's {V053_API_SERVER_SHARE:.0%} of the time beside scheduling's "
        f"{V053_SCHEDULING_SHARE:.0%} in vLLM's profile of v0.5.3 (blog 'vLLM v0.6.0: 2.7x Throughput "
        "Improvement', 2024-09-05); its workers, CUDA graphs and eager launches as vllm-0.4-offline's")
    v05_eager = dataclasses.replace(
        v05, name="vllm-0.5-eager", cuda_graph_max_batch=0,
        source=f"{v05.source}, but every step launched eagerly (--enforce-eager: no CUDA graphs)")
    profile = read_distserve_profile(distserve_profile)
    runs = read_distserve_runs(calibration / "distserve-vllm-opt13b-a100-80g")
    requests = [r for run in runs for r in run.trace.requests]
    shapes = replay_step_shapes([r.prompt_len for r in requests], [r.output_len for r in requests])
    offline, offline_fit = fit_engine_overhead(kernels, shapes, EngineOverhead(
        "vllm-0.2.3-offline", "DistServe (LLMServe/DistServe, commit 82831f1) "
        "simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json: its fitted step times of vLLM 0.2.3 "
        "run offline (vllm.LLM, worker_use_ray=True) on A100-SXM4-80GB, on the step shapes of its real runs' "
        f"lengths: OPT-13B at TP 1 -> gpu_slowdown, step, per_seq; at TP {WORKER_FIT_AT[1]} -> worker_step "
        f"(bench/data/distserve_vllm_0.2.3_profile.json; other degrees and OPT-66B held out); no CUDA graphs "
        f"in 0.2.3, {EAGER_SOURCE}; prompts padded to the longest in a prefill step (0.2.x's _prepare_prompt)",
        eager_launch=launch, pads_prompts=True))
    model, tp = WORKER_FIT_AT
    offline, worker_fit = fit_worker_step(kernels, offline, shapes, profile[WORKER_FIT_AT], get_config(model), tp)
    held = [profile_residuals(kernels, offline, shapes, lines, get_config(m), t)
            for (m, t), lines in sorted(profile.items()) if (m, t) not in (WORKER_FIT_AT, ("opt-13b", 1))]
    online, online_fit = fit_engine_to_runs(kernels, [r for r in runs if r.rate in CALIBRATED_RATES], EngineOverhead(
        "vllm-0.2.3-server", f"{DISTSERVE_RUNS}: each request's decoding window at "
        f"{', '.join(f'{r:g}' for r in CALIBRATED_RATES)} req/s -> gpu_slowdown, step, per_seq (the 2 and 4 "
        f"req/s runs held out); worker_step as vllm-0.2.3-offline's (the same version's Ray workers); no CUDA "
        f"graphs in 0.2.3, {EAGER_SOURCE}; prompts padded to the longest in a prefill step (0.2.x's "
        "_prepare_prompt)", eager_launch=launch, pads_prompts=True))
    online = dataclasses.replace(online, worker_step=offline.worker_step, worker_range=offline.worker_range)
    online_held = [run_residuals(online, kernels, r) for r in runs if r.rate not in CALIBRATED_RATES]
    jserve, jserve_fit = fit_jserve_overhead(jserve_overhead)
    engines = {e.name: e for e in (online, offline, v04, v05, v05_eager, jserve, FLAT_2MS)}
    sources = {"kernels": "Vidur (microsoft/vidur, MIT) operator profiles of vLLM on A100-80GB: "
                          "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv, "
                          "data/profiling/a100/attention.csv"}
    eager = Fit({"eager_launch": launch}, Residuals("eager launch per kernel (vLLM PR #1440, Llama-2-7B)",
                                                    1, 0.0, 0.0, 0.0))
    return PublishedFit(kernels, engines, sources), [
        *fits, eager, cpu, workers, online_fit, *online_held, offline_fit, worker_fit, *held, jserve_fit]


# ------------------------------------------------------------------------------- KV capacity


def peak_blocks(prompt: np.ndarray, output: np.ndarray, first: np.ndarray, last: np.ndarray,
                block_size: int = 16, every: float = 0.05) -> int:
    """The most KV blocks a run held at once, as its per-request times show it: a request
    holds its prompt's blocks from its first token to its last, growing one token per equal
    share of that span. Read the same way off a real run and off a simulated one, the two
    peaks compare a real engine's KV capacity with a simulated one's, whatever the
    estimate's bias (real token times are not evenly spaced)."""
    span = np.maximum(last - first, 1e-9)
    peak = 0
    for t in np.arange(first.min(), last.max(), every):
        live = (first <= t) & (last > t)
        tokens = prompt[live] + 1 + np.floor((t - first[live]) / span[live] * (output[live] - 1))
        peak = max(peak, int(np.ceil(tokens / block_size).sum()))
    return peak


def run_peak_blocks(run: PublishedRun, block_size: int = 16) -> int:
    prompt = np.array([r.prompt_len for r in run.trace.requests])
    output = np.array([r.output_len for r in run.trace.requests])
    first = np.array([r.arrival_time for r in run.trace.requests]) + run.ttft
    return peak_blocks(prompt, output, first, first + np.nan_to_num(run.tpot) * (output - 1), block_size)
