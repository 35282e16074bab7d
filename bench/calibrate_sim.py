"""Fit the simulator's measured kernels and engine-overhead profiles to published
measurements, print every fit with its residuals, and write the fit jserve ships
(`jserve/runners/data/published_a100.json`).

Reads `../shared/calibration/` (its README names the sources), DistServe's offline vLLM
0.2.3 profile (`bench/data/distserve_vllm_0.2.3_profile.json`) and this engine's measured
bookkeeping (`bench/results/engine_overhead.json`); `jserve.benchmarking.published_fit.fit_all`
says which measurement fixes which term and which are held out:
- Vidur's operator profiles -> the kernel efficiencies; its CPU profile -> `vllm-0.4-offline`;
- the real vLLM 0.2.3 server runs at 1 and 3 req/s -> `vllm-0.2.3-server` (2 and 4 held out);
- DistServe's offline profile at TP 1 and 2 -> `vllm-0.2.3-offline` (TP 4 and OPT-66B held
  out);
- vLLM PR #1440 -> the eager launch cost; vLLM's v0.5.3 profile -> the `vllm-0.5-*` estimates;
- bench/engine_overhead.py -> `jserve`.

Then prints DistServe's step times beside each profile's over a grid of decode and prefill
steps, and fits the KV capacity of the real server.

    python bench/calibrate_sim.py            # fit, print, write the shipped JSON
    python bench/calibrate_sim.py --check    # fit and print; fail if the shipped JSON differs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import tempfile

import numpy as np

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.metrics import percentiles
from jserve.benchmarking.published_fit import (
    DTYPE_BYTES,
    PROFILED_ON,
    Fit,
    Residuals,
    distserve_vllm_step_ms,
    fit_all,
    peak_blocks,
    run_peak_blocks,
)
from jserve.benchmarking.published_runs import PublishedRun, distserve_engine, read_distserve_runs
from jserve.benchmarking.workload import save_trace
from jserve.cache.sizing import block_bytes
from jserve.models.registry import get_config
from jserve.runners.cost_model import RooflineCostModel, StepShape
from jserve.runners.hardware import (
    ACTIVATION_PEAK_FACTOR,
    NON_TORCH_BYTES_PER_GPU,
    activation_reserve_bytes,
    get_hardware,
)
from jserve.runners.measured_cost import PUBLISHED, MeasuredCostModel, PublishedFit

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALIBRATION = ROOT.parent / "shared" / "calibration"
DISTSERVE_PROFILE = ROOT / "bench" / "data" / "distserve_vllm_0.2.3_profile.json"
JSERVE_OVERHEAD = ROOT / "bench" / "results" / "engine_overhead.json"
# The real run the KV capacity is fitted to (it reaches the cache's limit; 4 req/s is held out).
CAPACITY_RATE = 3.0


def sim_peak_blocks(run: PublishedRun, num_blocks: int) -> int:
    """`peak_blocks` of `run` replayed on the simulator with `num_blocks` KV blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/{run.name}.jsonl"
        save_trace(run.trace, path)
        result = run_benchmark(BenchConfig(engine=distserve_engine(num_blocks=num_blocks), trace=path),
                               progress=False)
    by_id = {r.request_id: r for r in result.records}
    done = [by_id[r.request_id] for r in run.trace.requests]
    start = min(r.arrival_time for r in done)
    first = np.array([r.first_token_time - start for r in done])
    last = np.array([r.finished_time - start for r in done])
    return peak_blocks(np.array([r.prompt_len for r in run.trace.requests]),
                       np.array([r.output_len for r in run.trace.requests]), first, last)


def fit_capacity(run: PublishedRun) -> tuple[int, float, list[tuple[int, int]]]:
    """The KV blocks whose simulated replay of `run` peaks where the real run peaked (both
    read by `peak_blocks`), by bisection, and the `ACTIVATION_PEAK_FACTOR` that sizes the
    cache so under the run's settings."""
    target = run_peak_blocks(run)
    lo, hi, tried = 2000, 4500, []
    while hi - lo > 10:
        mid = (lo + hi) // 2
        peak = sim_peak_blocks(run, mid)
        tried.append((mid, peak))
        lo, hi = (mid, hi) if peak < target else (lo, mid)
    blocks = (lo + hi) // 2
    engine = distserve_engine()
    cfg, hw, limits = engine.model_config(), get_hardware(engine.hardware), engine.limits
    reserve = (engine.gpu_memory_utilization * hw.memory_bytes - cfg.num_params * DTYPE_BYTES
               - blocks * block_bytes(cfg, engine.block_size, DTYPE_BYTES))
    per_unit = activation_reserve_bytes(cfg, DTYPE_BYTES, 1, limits.max_num_batched_tokens,
                                        limits.max_num_seqs) - NON_TORCH_BYTES_PER_GPU
    factor = (reserve - NON_TORCH_BYTES_PER_GPU) / (per_unit / ACTIVATION_PEAK_FACTOR)
    return blocks, factor, [(target, target)] + tried


def print_fits(fits: list[Fit | Residuals]) -> None:
    print("Fits to published measurements (relative error = model / measured - 1):")
    print(f"  {'term':<96} {'n':>5} {'rms':>6} {'p90':>6} {'max':>6}")
    for fit in fits:
        r = fit.residuals if isinstance(fit, Fit) else fit
        print(f"  {r.name[:96]:<96} {r.num_samples:>5} {r.rms:>6.1%} {r.p90_abs:>6.1%} {r.max_abs:>6.1%}")
        if isinstance(fit, Fit):
            print("      " + ", ".join(f"{k} = {v:.4g}" for k, v in fit.params.items()))


def print_distserve_grid(published: PublishedFit) -> None:
    """DistServe's vLLM 0.2.3 step times beside the models', OPT-13B on the A100-80GB."""
    cfg, hw = get_config("opt-13b"), get_hardware(PROFILED_ON)
    models = {name: MeasuredCostModel(cfg, hw, kernels=published.kernels, engine=engine)
              for name, engine in published.engines.items() if name.startswith("vllm")}
    models["roofline"] = RooflineCostModel(cfg, hw)
    print("\nOPT-13B steps on the A100-80GB, ms: DistServe's fit of vLLM 0.2.3 run offline vs ours")
    print(f"  {'step':<20} {'DistServe':>9} " + " ".join(f"{n:>18}" for n in models))
    steps = [(f"prefill {p}", StepShape.prefill(p)) for p in (64, 128, 256, 512, 1024, 2048)]
    steps += [(f"decode {b} x {c}", StepShape.decode([c] * b)) for b, c in
              ((1, 500), (16, 500), (32, 1000), (64, 500), (100, 600), (150, 400), (256, 200))]
    for label, shape in steps:
        real = distserve_vllm_step_ms(shape)
        cells = " ".join(f"{m.step_time(shape) * 1e3:>9.1f} ({m.step_time(shape) * 1e3 / real:4.2f}x)"
                         for m in models.values())
        print(f"  {label:<20} {real:>9.1f} {cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(CALIBRATION),
                        help="folder of the published measurements (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the shipped fit differs from this one")
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.calibration)
    if not folder.is_dir():
        sys.exit(f"no published measurements at {folder}: this script needs ../shared/calibration "
                 "beside the checkout, or --calibration FOLDER")
    published, fits = fit_all(folder, DISTSERVE_PROFILE, JSERVE_OVERHEAD)
    print_fits(fits)
    print_distserve_grid(published)
    runs = {run.rate: run for run in read_distserve_runs(folder / "distserve-vllm-opt13b-a100-80g")}
    blocks, factor, tried = fit_capacity(runs[CAPACITY_RATE])
    print(f"\nKV capacity of the real vLLM 0.2.3 server (16,384 batched tokens, 1,024 sequences, "
          f"0.95 of 80 GiB): the {CAPACITY_RATE:g} req/s run peaks at {tried[0][0]} blocks "
          f"(read off its token times);\n  the simulator replaying it peaks there with {blocks} "
          f"blocks (tried {', '.join(f'{b}->{p}' for b, p in tried[1:])}):")
    print(f"  ACTIVATION_PEAK_FACTOR = {factor:.2f} (jserve.runners.hardware has {ACTIVATION_PEAK_FACTOR}); "
          f"the weights alone would leave "
          f"{kv_blocks_without_activations()} blocks")
    for rate, run in runs.items():
        if rate != CAPACITY_RATE and percentiles(run.ttft, (90,))[0] > 1.0:
            print(f"  held out: the {rate:g} req/s run peaks at {run_peak_blocks(run)} blocks, "
                  f"the simulator at {sim_peak_blocks(run, distserve_engine().sim_kv_blocks())}")
    if args.check and abs(factor - ACTIVATION_PEAK_FACTOR) > 0.05 * ACTIVATION_PEAK_FACTOR:
        sys.exit(f"ACTIVATION_PEAK_FACTOR {ACTIVATION_PEAK_FACTOR} is not this fit's {factor:.2f}: update "
                 "jserve/runners/hardware.py")
    residuals = [dataclasses.asdict(f.residuals) | {"params": f.params} if isinstance(f, Fit)
                 else dataclasses.asdict(f) for f in fits]
    text = json.dumps(published.to_dict(residuals), indent=1) + "\n"
    if args.check:
        shipped = PublishedFit.from_dict(json.loads(PUBLISHED.read_text()))
        if not _close(shipped, published):
            sys.exit(f"{PUBLISHED} differs from this fit: run python bench/calibrate_sim.py")
        print(f"\n{PUBLISHED.relative_to(ROOT)} matches this fit")
        return
    PUBLISHED.write_text(text)
    print(f"\nwrote {PUBLISHED.relative_to(ROOT)}")


def kv_blocks_without_activations() -> int:
    engine = distserve_engine()
    cfg, hw = engine.model_config(), get_hardware(engine.hardware)
    free = engine.gpu_memory_utilization * hw.memory_bytes - cfg.num_params * DTYPE_BYTES
    return int(free // block_bytes(cfg, engine.block_size, DTYPE_BYTES))



def _close(a: PublishedFit, b: PublishedFit) -> bool:
    def numbers(fit: PublishedFit) -> list[float]:
        values = [v for v in dataclasses.asdict(fit.kernels).values() if isinstance(v, float)]
        for engine in fit.engines.values():
            values += [engine.step, engine.per_seq, engine.worker_step, engine.eager_launch, engine.gpu_slowdown]
        return values

    return a.engines.keys() == b.engines.keys() and all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) for x, y in zip(numbers(a), numbers(b)))


if __name__ == "__main__":
    main()
