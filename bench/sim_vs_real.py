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

Also printed: the saturation rate (the lowest rate whose TTFT p90 passes `SATURATED_TTFT`)
real vs simulated, and Llama-2-7B's offline ShareGPT throughput on one A100-80GB (1,000
requests at once, as vLLM's benchmark_throughput runs it) beside vLLM PR #5046's 14.33
(v0.4.2) and 15.62 req/s (v0.4.3).

    python bench/sim_vs_real.py                        # every cost model
    python bench/sim_vs_real.py --cost-model measured  # one
    python bench/sim_vs_real.py --runs DIR             # other real runs of the same setting
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

from jserve.benchmarking.bench import BenchConfig
from jserve.benchmarking.metrics import RequestRecord, tpot, ttft
from jserve.benchmarking.published_runs import PublishedRun, distserve_engine, read_distserve_runs
from jserve.benchmarking.sweep import run_points
from jserve.benchmarking.workload import save_trace
from jserve.config import EngineConfig
from jserve.runners.testbeds import COST_MODELS

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL_RUNS = ROOT.parent / "shared" / "calibration" / "distserve-vllm-opt13b-a100-80g"
RESULTS = ROOT / "bench" / "results"
PERCENTILES = (50, 90)
CALIBRATED_RATES = (1.0, 3.0)  # as bench/calibrate_sim.py
GOAL = 0.15  # every percentile within 15% of the real run's
# A run queueing without bound: the real 4 req/s run's TTFT p90 is 29 s, the 3 req/s run's 1.4 s.
SATURATED_TTFT = 5.0
# vLLM PR #5046: offline ShareGPT throughput of a Llama 7B on one GPU (A100 in vLLM's CI).
VLLM_OFFLINE_REQ_S = {"v0.4.2": 14.33, "v0.4.3": 15.62}
OFFLINE_REQUESTS = 1000


def percentiles(values: np.ndarray) -> dict[str, float]:
    values = values[np.isfinite(values)]
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


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
            r, s = percentiles(real), percentiles(sim)
            for p in r:
                row[f"{name}_{p}"] = {"real": r[p], "sim": s[p], "ratio": s[p] / r[p]}
        rows.append(row)
    return rows


def saturation_rate(rates: list[float], ttft_p90: list[float]) -> float | None:
    """The lowest rate whose TTFT p90 passes `SATURATED_TTFT` (None: none does)."""
    return next((r for r, t in zip(rates, ttft_p90) if t > SATURATED_TTFT), None)


def offline_throughput(cost_model: str) -> float:
    """Llama-2-7B on one A100-80GB, 1,000 ShareGPT requests at once, as vLLM's
    benchmark_throughput (vLLM's current scheduler defaults), in requests/s."""
    from jserve.benchmarking.bench import run_benchmark

    engine = EngineConfig(model="llama-2-7b", runner="sim", hardware="a100-80g", policy="vllm",
                          max_model_len=4096, cost_model=cost_model)
    result = run_benchmark(BenchConfig(engine=engine, workload="sharegpt", rate=math.inf,
                                       num_requests=OFFLINE_REQUESTS, seed=0), progress=False)
    return result.summary.throughput_rps


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
    rows = replay(runs, cost_models, args.workers)
    print_rows(rows)
    report: dict = {"rows": rows, "goal": GOAL, "saturation": {}, "offline": {}}
    rates = [run.rate for run in runs]
    real = saturation_rate(rates, [run_p90 for run_p90 in (percentiles(r.ttft)["p90"] for r in runs)])
    for cost_model in cost_models:
        mine = [row for row in rows if row["cost_model"] == cost_model]
        sim = saturation_rate(rates, [row["ttft_p90"]["sim"] for row in mine])
        within = sum(abs(row[c]["ratio"] - 1) <= GOAL for row in mine for c in COLUMNS)
        report["saturation"][cost_model] = {"real": real, "sim": sim}
        print(f"\n{cost_model}: {within} of {len(mine) * len(COLUMNS)} percentiles within {GOAL:.0%} of "
              f"the real runs; saturation (TTFT p90 > {SATURATED_TTFT:g} s) real {real} req/s, sim {sim} req/s")
        if not args.skip_offline:
            rps = offline_throughput(cost_model)
            report["offline"][cost_model] = rps
            published = ", ".join(f"vLLM {v} {x:.2f}" for v, x in VLLM_OFFLINE_REQ_S.items())
            print(f"  Llama-2-7B offline ShareGPT on one A100-80GB: {rps:.2f} req/s ({published})")
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
