#!/usr/bin/env python
"""Which of CacheOpt's components makes it preempt more than vLLM: each one off in turn.

The audit's setting (issue 28): OPT-13B on one simulated A100-80G, ShareGPT, Poisson
arrivals at 12 req/s, 1,500 requests, seed 21; 8-token blocks as in the reproduction
(Section 5's B). Every variant of `jserve.policies` ('cacheopt/CKA' ... '/PSS': the
paper's ablations, one component off each) beside vLLM and CacheOpt, on each cost model
asked for (the calibrated default `measured`, and `roofline`, the model before
calibration), through `sweep.run_points`. Per row: preemptions, how many were swaps, the
requests preempted at least once, the seconds spent preempted, P99 TTFT and TBT, mean TTFT.

    nice -n 10 python bench/cacheopt_preemptions.py        # ~10 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from jserve.benchmarking.bench import BenchConfig, BenchResult
from jserve.benchmarking.sweep import run_points
from jserve.config import EngineConfig

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ["vllm", "cacheopt", "cacheopt/CKA", "cacheopt/PA", "cacheopt/GR", "cacheopt/RSA",
            "cacheopt/PP", "cacheopt/PSS"]


def config(policy: str, cost_model: str, rate: float, num_requests: int, seed: int) -> BenchConfig:
    engine = EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g", policy=policy,
                          block_size=8, cost_model=cost_model)
    return BenchConfig(engine, workload="sharegpt", rate=rate, num_requests=num_requests, seed=seed)


def row(result: BenchResult) -> dict:
    recs, s = result.records, result.summary
    return {"preemptions": result.num_preemptions, "swaps": result.num_swaps,
            "requests_preempted": sum(r.num_preemptions > 0 for r in recs),
            "preempted_s": float(sum(r.preempted_time for r in recs)),
            "ttft_p99": s.ttft_p99, "tbt_p99": s.tbt_p99, "ttft_mean": s.ttft_mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost-model", action="append", help="measured, roofline, ... (repeatable; "
                    "default: measured and roofline)")
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--num-requests", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--output", default=str(RESULTS / "cacheopt_preemptions.json"))
    args = ap.parse_args()
    cost_models = args.cost_model or ["measured", "roofline"]
    variants = args.variants.split(",")
    configs = [config(v, cm, args.rate, args.num_requests, args.seed) for cm in cost_models for v in variants]
    results = iter(run_points(configs, workers=args.workers))
    table = {cm: {v: row(next(results)) for v in variants} for cm in cost_models}
    print(f"ShareGPT, OPT-13B, one A100-80G, {args.rate} req/s, {args.num_requests} requests, seed {args.seed}, "
          "8-token blocks")
    cols = ["preemptions", "swaps", "requests_preempted", "preempted_s", "ttft_p99", "tbt_p99", "ttft_mean"]
    for cm, rows in table.items():
        print(f"\ncost model {cm}\n{'variant':<14}" + "".join(f"{c:>20}" for c in cols))
        for v, r in rows.items():
            print(f"{v:<14}" + "".join(f"{'-' if r[c] is None else f'{r[c]:.4g}':>20}" for c in cols))
    out = pathlib.Path(args.output)
    out.write_text(json.dumps({"setting": {"rate": args.rate, "num_requests": args.num_requests,
                                           "seed": args.seed, "block_size": 8, "workload": "sharegpt",
                                           "model": "opt-13b", "hardware": "a100-80g"},
                               "table": table}, indent=1, default=lambda x: float(np.asarray(x))))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
