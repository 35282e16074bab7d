"""vLLM, Sarathi-Serve and FastGen at rising rates in the simulator (opt-13b on an A100
80GB, ShareGPT): SLO attainment and tail latency versus rate, effective throughput, and the
two shapes the baselines should show: vLLM's TTFT tail grows sharply past saturation, and
Sarathi's decode-first chunking keeps its TBT tail below vLLM's (vLLM stalls decodes
behind whole prefills).

    python bench/sweep_baselines.py [--num-requests 2000] [--rates 2,4,...]
"""

from __future__ import annotations

import argparse

from jserve.benchmarking.bench import BenchConfig
from jserve.benchmarking.sweep import run_sweep, write_sweep
from jserve.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rates", default="2,4,6,8,10,12,14,16")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default 2)")
    ap.add_argument("--tbt-slo", type=float, default=0.2, help="seconds, on per-request P99 TBT")
    ap.add_argument("--output", default="bench/results/sweep_opt-13b_a100-80g.json")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    base = BenchConfig(EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g"),
                       workload="sharegpt", num_requests=args.num_requests,
                       ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo)
    sweep = run_sweep(base, ["vllm", "sarathi", "fastgen"], rates, progress=False)
    print(f"{'rate':>6} | {'P99 TTFT (s)':^26} | {'P99 TBT (ms)':^26} | {'joint SLO attainment':^26}")
    print(f"{'':>6} | {'vllm':>8} {'sarathi':>8} {'fastgen':>8} | {'vllm':>8} {'sarathi':>8} {'fastgen':>8}"
          f" | {'vllm':>8} {'sarathi':>8} {'fastgen':>8}")
    res = sweep.results
    for k, rate in enumerate(rates):
        s = {p: res[p][k].summary for p in res}
        print(f"{rate:>6.1f} | " + " ".join(f"{s[p].ttft_p99:>8.2f}" for p in res) + " | "
              + " ".join(f"{1e3 * s[p].tbt_p99:>8.0f}" for p in res) + " | "
              + " ".join(f"{s[p].slo_attainment:>8.2f}" for p in res))
    for p in res:
        print(f"effective throughput (attainment >= 0.9) {p:>8}: {sweep.effective_throughput(p)} req/s")
    v, sa = res["vllm"], res["sarathi"]
    growth = v[-1].summary.ttft_p99 / v[0].summary.ttft_p99
    lower = sum(s.summary.tbt_p99 < x.summary.tbt_p99 for s, x in zip(sa, v))
    print(f"vllm P99 TTFT grows {growth:.0f}x from {rates[0]} to {rates[-1]} req/s")
    print(f"sarathi P99 TBT below vllm's at {lower} of {len(rates)} rates")
    png = write_sweep(sweep, args.output)
    print(f"wrote {args.output} and {png}")


if __name__ == "__main__":
    main()
