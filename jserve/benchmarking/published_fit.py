"""Fits of the simulator's measured cost model to published A100 measurements.

Two sources, both in `../shared/calibration/` (its README names them; none of their code is
used here, only their figures):

- Vidur's operator profiles of vLLM on an A100-80GB (microsoft/vidur, MIT): every linear layer,
  norm, activation and residual add of Llama-2-7B over token counts and tensor-parallel
  degrees (`llama-2-7b_mlp.csv`), the FlashAttention prefill and paged decode kernels over
  batch shapes (`attention.csv`, Llama-2-70B's heads at TP 2), and vLLM's per-step CPU time
  by batch size (`cpu_overheads.csv`). These fix the kernel efficiencies (`KernelFit`) and a
  serving engine's CPU time per step (`EngineOverhead` "vllm-vidur").
- DistServe's fitted step times of vLLM 0.2.3 serving OPT-13B on an A100-80GB (LLMServe/
  DistServe, Apache-2.0; the formulas are quoted in the README): what that engine adds to the
  kernels, fitted as `EngineOverhead` "vllm-0.2.3" on the step shapes a ShareGPT replay
  visits.

Each fit is a least-squares fit of relative error (short steps count as much as long ones)
and returns its residuals, which `bench/calibrate_sim.py` prints. The fitted numbers ship as
`jserve/runners/data/published_a100.json`; `jserve.runners.measured_cost` reads them.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jserve.benchmarking.published_runs import PublishedRun
from jserve.runners.cost_model import StepShape, nnls
from jserve.runners.hardware import Hardware, get_hardware
from jserve.runners.measured_cost import EngineOverhead, KernelFit, MeasuredCostModel
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


def fit_elementwise(rows: list[dict[str, str]]) -> Fit:
    """A layer's element-wise kernels (two norms, rotary embedding, activation, two residual
    adds) as `launch + rate * tokens * hidden`, at TP 1."""
    rows = [r for r in rows if r["num_tensor_parallel_workers"] == "1"]
    x = np.array([int(r["num_tokens"]) * int(r["n_embd"]) for r in rows], float)
    t = np.array([sum(float(r[f"time_stats.{op}.median"]) for op in ELEMENTWISE_OPS) * 1e-3 for r in rows])

    def model(p: np.ndarray) -> np.ndarray:
        return p[0] * 1e-6 + p[1] * 1e-12 * x

    p = _relative_fit(model, t, [20, 10], [0, 0], [1000, 1e4])
    return Fit({"elementwise_launch": p[0] * 1e-6, "elementwise_rate": p[1] * 1e-12},
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


CPU_PHASES = ("schedule", "prepare_inputs_e2e", "sampler_e2e", "process_model_outputs")


def fit_cpu_overhead(rows: list[dict[str, str]], model_name: str = VIDUR_CPU_MODEL) -> Fit:
    """vLLM's CPU time per step outside the model's kernels (schedule, prepare inputs,
    sampling, process outputs), `step + per_seq * batch`, ordinary least squares of
    relative error."""
    rows = [r for r in rows if r["model_name"] == model_name and r["tensor_parallel_degree"] == "1"]
    b = np.array([int(r["batch_size"]) for r in rows], float)
    t = np.array([sum(float(r[f"{phase}_median"]) for phase in CPU_PHASES) * 1e-3 for r in rows])
    x = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    step, per_seq = np.linalg.lstsq(x, np.ones_like(t), rcond=None)[0]
    predicted = step + per_seq * b
    return Fit({"step": float(step), "per_seq": float(per_seq)},
               Residuals.of(f"CPU time per step (Vidur, {model_name.split('/')[-1]})", predicted, t))


def fit_kernels(folder: pathlib.Path) -> tuple[KernelFit, list[Fit]]:
    """Every kernel term from Vidur's profiles in `folder`."""
    hw = get_hardware(PROFILED_ON)
    mlp = read_profile_csv(folder / "llama-2-7b_mlp.csv")
    attention = read_profile_csv(folder / "attention.csv")
    fits = [fit_gemms(mlp, hw), fit_elementwise(mlp), fit_prefill_attention(attention, hw),
            fit_decode_attention(attention, hw)]
    params = {k: v for fit in fits for k, v in fit.params.items()}
    return KernelFit(**params), fits


# ------------------------------------------------------------------------------- DistServe


def distserve_vllm_step_ms(shape: StepShape, prompt_lens: Sequence[int] = ()) -> float:
    """DistServe's fit of vLLM 0.2.3's step time for OPT-13B on one A100-80GB (its
    `profiler-a100-80g.vllm.json` as quoted in ../shared/calibration/README.md): a prefill
    step by its prompt tokens and their squares, a decode step by the context it reads and
    its batch (two lines, split at batch 95)."""
    if shape.num_prefill_tokens:
        squares = sum(p * p for p in prompt_lens) if prompt_lens else shape.prefill_square
        return 22.05 + 0.14051 * shape.num_prefill_tokens + 8.0766e-6 * squares
    if shape.num_seqs < 95:
        return 23.475 + 0.00059293 * shape.decode_context + 0.060727 * shape.num_seqs
    return 20.206 + 0.00049077 * shape.decode_context + 0.12000 * shape.num_seqs


def fit_engine_overhead(kernels: KernelFit, shapes: Sequence[StepShape], name: str,
                        source: str, model: ModelConfig | None = None) -> tuple[EngineOverhead, Fit]:
    """What vLLM 0.2.3 adds to the measured kernels: DistServe's step times on `shapes` (the
    steps a replay of real traffic runs) as `gpu_slowdown * kernels + step + per_seq * seqs`,
    least squares of relative error. Steps with both prefills and decodes do not exist in
    vLLM 0.2.3 and are skipped."""
    model = model or get_config("opt-13b")
    hw = get_hardware(PROFILED_ON)
    shapes = [s for s in shapes if s.num_tokens and not (s.num_prefill_tokens and s.num_decode_tokens)]
    bare = MeasuredCostModel(model, hw, kernels=kernels, engine=EngineOverhead.none())
    gpu = np.array([bare.kernel_time(s) for s in shapes])
    seqs = np.array([s.num_seqs for s in shapes], float)
    t = np.array([distserve_vllm_step_ms(s) * 1e-3 for s in shapes])
    prefill = np.array([s.num_prefill_tokens > 0 for s in shapes])
    # Prefill and decode steps weigh the same in all, however many of each the grid has;
    # no term may be negative (`nnls`).
    weight = np.where(prefill, 1.0 / prefill.sum(), 1.0 / (~prefill).sum()) ** 0.5 / t
    x = np.stack([gpu, np.ones_like(gpu), seqs], axis=1)
    slowdown, step, per_seq = nnls(x * weight[:, None], t * weight)
    engine = EngineOverhead(name, step=float(step), per_seq=float(per_seq),
                            gpu_slowdown=float(slowdown), source=source)
    fitted = MeasuredCostModel(model, hw, kernels=kernels, engine=engine)
    predicted = np.array([fitted.step_time(s) for s in shapes])
    params = {"gpu_slowdown": engine.gpu_slowdown, "step": engine.step, "per_seq": engine.per_seq}
    fit = Fit(params, Residuals.of(f"{name}: DistServe's vLLM 0.2.3 step times, OPT-13B "
                                   f"({int(prefill.sum())} prefill, {int((~prefill).sum())} decode steps)",
                                   predicted, t))
    return engine, fit


def _window_features(run: PublishedRun, kernels: MeasuredCostModel, min_output: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request of `run` that decoded at least `min_output` tokens: the time from its
    first to its last token, and what vLLM ran meanwhile as `(kernel seconds, steps,
    sequence-steps)`. vLLM 0.2.3 never mixes prefills and decodes, so that window holds the
    request's `output - 1` decode steps, priced as the average batch it decoded in (the
    requests decoding beside it, and their average context), and the prefill step of every
    request whose first token came inside it."""
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
        gpu = steps * kernels.kernel_time(StepShape.decode(np.full(width, round(context))))
        gpu += sum(kernels.kernel_time(StepShape.prefill(int(prompt[j]))) for j in prefills)
        rows.append([gpu, steps + len(prefills), steps * batch + len(prefills)])
        seconds.append(end - start)
    return np.array(rows), np.array(seconds)


def fit_engine_to_runs(kernels: KernelFit, runs: Sequence[PublishedRun], name: str, source: str,
                       model: ModelConfig | None = None, min_output: int = 8) -> tuple[EngineOverhead, Fit]:
    """An engine's overhead fitted to real runs (`gpu_slowdown * kernels + step + per_seq *
    sequences`, per step): each request's decoding window (`_window_features`) as measured,
    least squares of relative error, no term negative."""
    bare = MeasuredCostModel(model or get_config("opt-13b"), get_hardware(PROFILED_ON), kernels=kernels,
                             engine=EngineOverhead.none())
    features = [_window_features(run, bare, min_output) for run in runs]
    x = np.concatenate([f[0] for f in features])
    t = np.concatenate([f[1] for f in features])
    slowdown, step, per_seq = nnls(x / t[:, None], np.ones_like(t))
    engine = EngineOverhead(name, step=float(step), per_seq=float(per_seq), gpu_slowdown=float(slowdown),
                            source=source)
    rates = ", ".join(f"{run.rate:g}" for run in runs)
    fit = Fit({"gpu_slowdown": engine.gpu_slowdown, "step": engine.step, "per_seq": engine.per_seq},
              Residuals.of(f"{name}: decode windows of the real runs at {rates} req/s",
                           x @ np.array([slowdown, step, per_seq]), t))
    return engine, fit


def run_residuals(engine: EngineOverhead, kernels: KernelFit, run: PublishedRun,
                  model: ModelConfig | None = None, min_output: int = 8) -> Residuals:
    """How well `engine` predicts the decoding windows of a run it was not fitted to."""
    bare = MeasuredCostModel(model or get_config("opt-13b"), get_hardware(PROFILED_ON), kernels=kernels,
                             engine=EngineOverhead.none())
    x, t = _window_features(run, bare, min_output)
    return Residuals.of(f"{engine.name}: decode windows at {run.rate:g} req/s (held out)",
                        x @ np.array([engine.gpu_slowdown, engine.step, engine.per_seq]), t)


def replay_step_shapes(prompts: Sequence[int], outputs: Sequence[int], *, max_batch: int = 256,
                       max_tokens: int = 2048, kv_tokens: int = 66_144, draws: int = 4,
                       seed: int = 0) -> list[StepShape]:
    """The steps a vLLM replay of requests of these lengths runs, for fitting an engine's
    overhead where serving lives: each prompt's prefill alone and in pairs that fit the token
    budget, and `draws` decode batches of each size from 1 to `max_batch`, of requests drawn
    from the trace at uniform points of their outputs, within the KV capacity."""
    rng = np.random.default_rng(seed)
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    shapes = [StepShape.prefill(int(p)) for p in prompts]
    pairs = rng.integers(0, len(prompts), (len(prompts), 2))
    shapes += [StepShape.from_lens([0, 0], prompts[pair]) for pair in pairs
               if prompts[pair].sum() <= max_tokens]
    for batch in np.repeat(np.arange(1, max_batch + 1), draws):
        picks = rng.integers(0, len(prompts), batch)
        context = prompts[picks] + np.ceil(rng.random(batch) * outputs[picks]).astype(int)
        if context.sum() <= kv_tokens:
            shapes.append(StepShape.decode(context))
    return shapes


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
