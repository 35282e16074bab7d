"""The simulator against real serving runs: published vLLM runs replayed request by request.

`../shared/calibration/distserve-vllm-opt13b-a100-80g/` holds per-request results of real
vLLM 0.2.3 runs (OPT-13B on one A100-SXM4-80GB, ShareGPT, Poisson arrivals at 1-4 req/s;
from the DistServe project, whose README there names the source). Each run is replayed
through the simulator with the same arrival times and lengths and the server's settings
(`jserve.benchmarking.published_runs.distserve_engine`: vLLM 0.2.3's scheduler, 0.95 of
memory, 16,384 batched tokens, 1,024 sequences), and the simulator's TTFT and TPOT
percentiles are printed beside the real ones with their ratio, per rate and cost model.
`bench/calibrate_sim.py` fitted the measured model's engine terms to the runs at 1 and 3 req/s
(and its KV capacity to the 3 req/s run); the rates it did not see are marked held out.

Also printed, each beside real runs that are not in `../shared/` and were not fitted:
- the saturation rate (the lowest rate whose TTFT p90 passes `SATURATED_TTFT`), real vs
  simulated;
- offline ShareGPT throughput (1,000 requests at once, as vLLM's benchmark_throughput runs
  it) under `vllm-0.4-offline`: Llama-2-7B on one A100-80GB and Llama-2-70B on four, beside
  vLLM PR #5046's v0.4.2 and v0.4.3 figures, and the same 7B run on an H100 over the A100;
- OPT-13B's and OPT-66B's prefill and decode step times at TP 1, 2, 4 and 8 under
  `vllm-0.2.3-offline`, beside DistServe's profile of vLLM 0.2.3 (`bench/data/`), of which
  only OPT-13B at TP 1 and 2 were fitted.

    python bench/sim_vs_real.py                        # every cost model
    python bench/sim_vs_real.py --cost-model measured  # one
    python bench/sim_vs_real.py --runs DIR             # other real runs of the same setting
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile

import numpy as np

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.metrics import RequestRecord, percentiles, tpot, ttft
from jserve.benchmarking.published_fit import WORKER_FIT_AT, read_distserve_profile
from jserve.benchmarking.published_runs import PublishedRun, distserve_engine, read_distserve_runs
from jserve.benchmarking.sweep import run_points
from jserve.benchmarking.workload import save_trace
from jserve.config import EngineConfig
from jserve.models.registry import get_config
from jserve.runners.cost_model import StepShape
from jserve.runners.hardware import get_hardware
from jserve.runners.testbeds import COST_MODELS, describe, make_cost_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL_RUNS = ROOT.parent / "shared" / "calibration" / "distserve-vllm-opt13b-a100-80g"
RESULTS = ROOT / "bench" / "results"
PERCENTILES = (50, 90)
CALIBRATED_RATES = (1.0, 3.0)  # as bench/calibrate_sim.py
GOAL = 0.15  # every percentile within 15% of the real run's
# A run queueing without bound: the real 4 req/s run's TTFT p90 is 29 s, the 3 req/s run's 1.4 s.
SATURATED_TTFT = 5.0
# vLLM PR #5046 (v0.4.3's release, 2024-05-25): offline ShareGPT throughput in requests/s
# and tokens/s (prompt and output), "1GPU, Llama 7B" and "4GPU, Llama 70B" (A100s in vLLM's
# benchmark CI of the time), vLLM v0.4.2 and v0.4.3.
PR5046 = {("llama-2-7b", 1): {"v0.4.2": (14.33, 6895.75), "v0.4.3": (15.62, 7516.03)},
          ("llama-2-70b", 4): {"v0.4.2": (8.05, 3871.86), "v0.4.3": (10.15, 4884.14)}}
OFFLINE_REQUESTS = 1000
OFFLINE_STACK = "vllm-0.4-offline"
DISTSERVE_PROFILE = ROOT / "bench" / "data" / "distserve_vllm_0.2.3_profile.json"
STEP_TABLE_TP = (1, 2, 4, 8)
STEP_TABLE_STEPS = (("prefill 512", StepShape.prefill(512)), ("prefill 2048", StepShape.prefill(2048)),
                    ("decode 16 x 500", StepShape.decode([500] * 16)),
                    ("decode 128 x 500", StepShape.decode([500] * 128)))


def by_percentile(values: np.ndarray) -> dict[str, float | None]:
    """PERCENTILES of the finite values (a request without a TPOT is NaN), keyed p50, p90."""
    return dict(zip((f"p{p}" for p in PERCENTILES), percentiles(values[np.isfinite(values)], PERCENTILES)))


def sim_latencies(records: list[RequestRecord], run: PublishedRun) -> tuple[np.ndarray, np.ndarray]:
    """The simulated TTFT and TPOT of `run`'s requests, in its order."""
    by_id = {r.request_id: r for r in records}
    done = [by_id[r.request_id] for r in run.trace.requests]
    return (np.array([ttft(r) for r in done], dtype=float),
            np.array([math.nan if tpot(r) is None else tpot(r) for r in done], dtype=float))


def replay(runs: list[PublishedRun], cost_models: list[str], workers: int | None) -> list[dict]:
    """One row per (cost model, run): each percentile real, simulated and their ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        configs = []
        for cost_model in cost_models:
            for run in runs:
                path = f"{tmp}/{run.name}.jsonl"
                save_trace(run.trace, path)
                configs.append(BenchConfig(engine=distserve_engine(cost_model=cost_model), trace=path))
        results = run_points(configs, workers=workers)
    rows = []
    for k, result in enumerate(results):
        run = runs[k % len(runs)]
        sim_ttft, sim_tpot = sim_latencies(result.records, run)
        row = {"cost_model": cost_models[k // len(runs)], "run": run.name, "rate": run.rate,
               "held_out": run.rate not in CALIBRATED_RATES, "preemptions": result.num_preemptions}
        for name, real, sim in (("ttft", run.ttft, sim_ttft), ("tpot", run.tpot, sim_tpot)):
            r, s = by_percentile(real), by_percentile(sim)
            for p in r:
                row[f"{name}_{p}"] = {"real": r[p], "sim": s[p], "ratio": s[p] / r[p]}
        rows.append(row)
    return rows


def saturation_rate(rates: list[float], ttft_p90: list[float]) -> float | None:
    """The lowest rate whose TTFT p90 passes `SATURATED_TTFT` (None: none does)."""
    return next((r for r, t in zip(rates, ttft_p90) if t > SATURATED_TTFT), None)


def offline_throughput(cost_model: str, model: str = "llama-2-7b", hardware: str = "a100-80g",
                       tp: int = 1) -> tuple[float, float]:
    """1,000 ShareGPT requests at once on the simulator under `OFFLINE_STACK`, as vLLM's
    benchmark_throughput runs them (vLLM's scheduler defaults): requests/s and tokens/s."""
    engine = EngineConfig(model=model, runner="sim", hardware=hardware, policy="vllm", max_model_len=4096,
                          cost_model=cost_model, engine_overhead=OFFLINE_STACK, tensor_parallel_size=tp)
    result = run_benchmark(BenchConfig(engine=engine, workload="sharegpt", rate=math.inf,
                                       num_requests=OFFLINE_REQUESTS, seed=0), progress=False)
    return result.summary.throughput_rps, result.vllm["total_token_throughput"]


def offline_report(cost_model: str) -> dict:
    """The offline figures beside PR #5046, and the 7B run's H100 / A100 ratio."""
    report = {}
    for (model, tp), published in PR5046.items():
        rps, tps = offline_throughput(cost_model, model, "a100-80g", tp)
        report[f"{model} tp{tp}"] = {"sim": (rps, tps), "published": published}
        cells = ", ".join(f"vLLM {v} {r:.2f} req/s, {t:,.0f} tok/s ({rps / r:.2f}x, {tps / t:.2f}x)"
                          for v, (r, t) in published.items())
        print(f"  {model} offline ShareGPT on {tp} A100-80GB under {OFFLINE_STACK}: {rps:.2f} req/s, "
              f"{tps:,.0f} tok/s; {cells}")
    h100 = offline_throughput(cost_model, "llama-2-7b", "h100")[0]
    a100 = report["llama-2-7b tp1"]["sim"][0]
    report["h100_over_a100"] = h100 / a100
    print(f"  llama-2-7b on one H100: {h100:.2f} req/s, {h100 / a100:.2f}x the A100-80GB's (an estimate: "
          "the kernels were measured on A100s and scale by the datasheets)")
    return report


def step_table(cost_model: str) -> list[dict]:
    """OPT-13B and OPT-66B step times at TP 1-8 under vllm-0.2.3-offline beside DistServe's
    profile of vLLM 0.2.3 where it has the (model, TP)."""
    profile = read_distserve_profile(DISTSERVE_PROFILE)
    fitted = {("opt-13b", 1), WORKER_FIT_AT}
    rows = []
    print(f"\nstep times under vllm-0.2.3-offline ({cost_model} kernels, A100-80GB), ms: ours / DistServe's "
          "profile of vLLM 0.2.3 (x); * fitted there, the rest held out")
    print(f"  {'model':>8} {'tp':>3} " + " ".join(f"{label:>24}" for label, _ in STEP_TABLE_STEPS))
    for model in ("opt-13b", "opt-66b"):
        for tp in STEP_TABLE_TP:
            if get_config(model).num_params * 2 / tp > get_hardware("a100-80g").memory_bytes:
                print(f"  {model:>8} {tp:>2}  its weights do not fit {tp} A100-80GB")
                continue
            cost = make_cost_model(cost_model, get_config(model), get_hardware("a100-80g"), tensor_parallel=tp,
                                   engine_overhead="vllm-0.2.3-offline")
            lines = profile.get((model, tp))
            cells, row = [], {"model": model, "tp": tp, "fitted": (model, tp) in fitted}
            for label, shape in STEP_TABLE_STEPS:
                ours = cost.step_time(shape) * 1e3
                real = lines.step_ms(shape) if lines else None
                row[label] = {"sim": ours, "real": real}
                cells.append(f"{ours:7.1f} / {real:6.1f} ({ours / real:4.2f}x)" if real else f"{ours:7.1f} / {'-':>6}       ")
            mark = "*" if row["fitted"] else " "
            print(f"  {model:>8} {tp:>2}{mark} " + " ".join(f"{c:>24}" for c in cells))
            rows.append(row)
    return rows


COLUMNS = [f"{m}_p{p}" for m in ("ttft", "tpot") for p in PERCENTILES]


def print_rows(rows: list[dict]) -> None:
    print(f"{'cost model':>10} {'rate':>5} {'':>8} " + " ".join(f"{c + ' real / sim (x)':>27}" for c in COLUMNS))
    for row in rows:
        cells = " ".join(f"{row[c]['real'] * 1e3:>8.0f} {row[c]['sim'] * 1e3:>8.0f} ({row[c]['ratio']:4.2f}x)"
                         for c in COLUMNS)
        mark = "held out" if row["held_out"] else "fitted"
        print(f"{row['cost_model']:>10} {row['rate']:>5.1f} {mark:>8} {cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-model", action="append", choices=COST_MODELS,
                        help="cost model(s) to replay on (default: measured and roofline)")
    parser.add_argument("--runs", default=str(REAL_RUNS),
                        help="folder of DistServe vllm-N-R.exp runs (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    parser.add_argument("--skip-offline", action="store_true", help="skip the Llama-2-7B throughput check")
    parser.add_argument("--out", default=str(RESULTS / "sim_vs_real.json"))
    args = parser.parse_args(argv)
    try:
        runs = read_distserve_runs(args.runs)
    except FileNotFoundError as e:
        sys.exit(f"{e}: this script needs ../shared/calibration beside the checkout, or --runs DIR")
    cost_models = args.cost_model or ["measured", "roofline"]
    for cost_model in cost_models:
        print(describe(cost_model, get_hardware("a100-80g")))
    rows = replay(runs, cost_models, args.workers)
    print_rows(rows)
    report: dict = {"rows": rows, "goal": GOAL, "saturation": {}, "offline": {}}
    rates = [run.rate for run in runs]
    real = saturation_rate(rates, [run_p90 for run_p90 in (by_percentile(r.ttft)["p90"] for r in runs)])
    for cost_model in cost_models:
        mine = [row for row in rows if row["cost_model"] == cost_model]
        sim = saturation_rate(rates, [row["ttft_p90"]["sim"] for row in mine])
        within = sum(abs(row[c]["ratio"] - 1) <= GOAL for row in mine for c in COLUMNS)
        report["saturation"][cost_model] = {"real": real, "sim": sim}
        print(f"\n{cost_model}: {within} of {len(mine) * len(COLUMNS)} percentiles within {GOAL:.0%} of "
              f"the real runs; saturation (TTFT p90 > {SATURATED_TTFT:g} s) real {real} req/s, sim {sim} req/s")
        if not args.skip_offline:
            report["offline"][cost_model] = offline_report(cost_model)
        report.setdefault("steps", {})[cost_model] = step_table(cost_model)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
