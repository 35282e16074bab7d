"""Simulator fidelity on this machine: calibrate the cost model on SmolLM2 (on this
machine's CPU or GPU), then run the same ShareGPT trace on the real engine and in the
simulator and print P50/P99 TTFT and TBT side by side (issue goal: within 10%).

Both runs use the same trace file, policy, KV cache size and limits; only the runner and
the clock differ. `--trace` replays a saved trace (no dataset needed); without it a trace
of `--num-requests` at `--rate` is sampled from ShareGPT and saved. Results go to
`sim_fidelity_<device>.json` (`cpu`, or the GPU's kind as JAX reports it).

    python bench/sim_fidelity.py [--num-requests 48] [--rate 0.4] [--profile FILE]
    python bench/sim_fidelity.py --trace bench/results/fidelity_trace_gpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
from datetime import date

from device_timing import device_name, on_gpu, results_tag

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.calibrate import run_profile
from jserve.benchmarking.workload import build_trace, load_trace, save_trace
from jserve.config import EngineConfig

GOAL = 0.10
ROWS = [("TTFT p50", "ttft_p50"), ("TTFT p99", "ttft_p99"), ("TBT p50", "tbt_p50"),
        ("TBT p99", "tbt_p99"), ("TPOT mean", "tpot_mean"), ("E2E mean", "e2e_mean")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=0.4, help="requests/s")
    ap.add_argument("--max-total-len", type=int, default=768)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--profile", default=None, help="reuse a profile instead of measuring one")
    ap.add_argument("--trace", default=None,
                    help="replay this saved trace (--num-requests and --rate are then unused)")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tag = results_tag()
    profile = args.profile or str(out / f"profile_smollm2-135m_{tag}.json")
    if args.profile is None:
        fitted = run_profile("smollm2-135m", profile, max_len=args.max_total_len)
        err = abs(fitted.fit_errors())
        print(f"profile: {len(fitted.samples)} shapes, mean |fit error| {100 * err.mean():.1f}%")

    if args.trace:
        trace_path = pathlib.Path(args.trace)
        trace = load_trace(str(trace_path))
        args.num_requests, args.rate = len(trace.requests), trace.rate
    else:
        trace_path = out / "fidelity_trace.jsonl"
        save_trace(build_trace("sharegpt", args.num_requests, args.rate, seed=0,
                               max_total_len=args.max_total_len), trace_path)
    common = dict(policy=args.policy, model="smollm2-135m", max_model_len=args.max_total_len,
                  num_blocks=args.num_blocks)
    real = run_benchmark(BenchConfig(EngineConfig(runner="real", **common), trace=str(trace_path)))
    sim = run_benchmark(BenchConfig(EngineConfig(runner="sim", profile=profile, **common),
                                    trace=str(trace_path)))

    print(f"\n{'metric':>10} {'real (s)':>10} {'sim (s)':>10} {'sim/real':>9}")
    rows = {}
    for label, field in ROWS:
        r, s = getattr(real.summary, field), getattr(sim.summary, field)
        rows[field] = {"real": r, "sim": s, "ratio": s / r if r else None}
        print(f"{label:>10} {r:>10.3f} {s:>10.3f} {s / r:>9.2f}")
    worst = max(abs(rows[f]["ratio"] - 1) for _, f in ROWS[:4])
    print(f"goal: P50/P99 TTFT and TBT within {100 * GOAL:.0f}% ... worst {100 * worst:.1f}%  "
          f"{'PASS' if worst <= GOAL else 'MISS'}")
    print(f"steps: real {real.num_steps}, sim {sim.num_steps}; preemptions: real "
          f"{real.num_preemptions}, sim {sim.num_preemptions}")
    result = out / f"sim_fidelity_{tag}.json"
    result.write_text(json.dumps({
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus"
                   + (f", {device_name()}" if on_gpu() else ""),
        "profile": profile,
        "config": common | {"trace": str(trace_path), "num_requests": args.num_requests,
                            "rate": args.rate},
        "metrics": rows, "worst_relative_error": worst, "goal": GOAL,
        "steps": {"real": real.num_steps, "sim": sim.num_steps},
    }, indent=1))
    print(f"wrote {result}")


if __name__ == "__main__":
    main()
