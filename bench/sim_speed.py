"""How fast the simulator replays a large trace: 10,000 ShareGPT requests under vllm on
opt-13b / a100-80g (goal: < 10 s on one core, issue 12). Trace sampling (tokenizing ShareGPT)
is timed apart from the simulation itself.

Then the command a user types, timed as a user meets it (a fresh process, twice: the second
run finds the ShareGPT lengths cached): `jserve bench --engine sim --model opt-13b
--hardware a100-80g --workload sharegpt --rate 2 --num-requests 10000` (goal: second run
< 20 s wall). At rate 2 most steps are plain decodes, which the simulator books many at a
time (`Plan.repeat`); at rate 20 (the first figure) fewer are.

    python bench/sim_speed.py [--num-requests 10000] [--policy vllm] [--rate 20] [--no-cli]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from datetime import date

from jserve.benchmarking.bench import BenchConfig, make_trace, trace_prompt_ids
from jserve.benchmarking.replay import replay
from jserve.builder import build_engine
from jserve.config import EngineConfig

GOAL_S = 10.0
CLI_GOAL_S = 20.0  # `jserve bench` at rate 2, second run, wall
CLI_RATE = 2.0


def time_cli(num_requests: int, policy: str) -> float:
    """Wall seconds of one `jserve bench` process at rate 2 (its report is not shown)."""
    cmd = [sys.executable, "-m", "jserve", "bench", "--engine", "sim", "--model", "opt-13b",
           "--hardware", "a100-80g", "--workload", "sharegpt", "--policy", policy,
           "--rate", str(CLI_RATE), "--num-requests", str(num_requests)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--no-cli", action="store_true", help="skip timing the `jserve bench` command")
    ap.add_argument("--output", default="bench/results/sim_speed.json")
    args = ap.parse_args()
    engine = EngineConfig(runner="sim", policy=args.policy, model="opt-13b", hardware="a100-80g")
    cfg = BenchConfig(engine, workload="sharegpt", rate=args.rate, num_requests=args.num_requests)
    t0 = time.perf_counter()
    trace = make_trace(cfg)
    t_trace = time.perf_counter() - t0
    built = build_engine(cfg.engine)
    clock = built.clock
    t0 = time.perf_counter()
    records = replay(built.engine, trace, clock, trace_prompt_ids(cfg, built))
    t_sim = time.perf_counter() - t0
    steps = built.engine.stats.num_steps
    print(f"trace sampling: {t_trace:.1f} s for {len(trace.requests)} ShareGPT requests")
    print(f"simulation:     {t_sim:.1f} s for {len(records)} requests, {steps} steps "
          f"({1e6 * t_sim / steps:.0f} us/step), {clock.now():.0f} s of simulated time "
          f"({clock.now() / t_sim:.0f}x real time)")
    verdict = "PASS" if t_sim < GOAL_S else "MISS"
    print(f"goal: < {GOAL_S:.0f} s ........ {t_sim:.1f} s  {verdict}")
    cli = {}
    if not args.no_cli:
        first, second = time_cli(args.num_requests, args.policy), time_cli(args.num_requests, args.policy)
        verdict = "PASS" if second < CLI_GOAL_S else "MISS"
        print(f"jserve bench --rate {CLI_RATE:g} --num-requests {args.num_requests}: first run "
              f"{first:.1f} s, second {second:.1f} s wall; goal (second) < {CLI_GOAL_S:.0f} s  {verdict}")
        cli = {"cli_rate": CLI_RATE, "cli_first_seconds": first, "cli_second_seconds": second,
               "cli_goal_seconds": CLI_GOAL_S}
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus", "num_requests": len(records), "policy": args.policy,
        "rate": args.rate, "trace_seconds": t_trace, "sim_seconds": t_sim, "steps": steps,
        "simulated_seconds": clock.now(), "goal_seconds": GOAL_S, **cli,
    }, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
