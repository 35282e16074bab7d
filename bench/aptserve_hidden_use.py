#!/usr/bin/env python
"""Where Apt-Serve's hidden cache goes in one simulated run: per plan, how many waiting
requests are admitted on each cache type, and what happens to running hidden requests (kept
on the hidden cache for a decode, moved to KV in the same step or by preemption, left out).

It answers why the hidden cache does not enlarge the decode batch (issue 28,
bench/results/aptserve_reproduction.md): a running request's pending time is 0 right after
its decode step, so Eq. 5's hidden value is negative and the refinement leaves it KV only.
It also counts the hidden admissions the paper's refinement would have kept on KV (admitted
because only the hidden half fit: the `apt-serve-hidden-fit` variant, issue 41).

    python bench/aptserve_hidden_use.py --cost-model apt-serve --policy apt-serve --rate 3.5
    # the default before issue 41, our three readings on:
    python bench/aptserve_hidden_use.py --rate 3.5 --readings hidden_fallback,count_late,skip
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.config import EngineConfig
from jserve.cache_features.hidden_cache.section import CacheType, cache_types, request_types
from jserve.engine.plan import Plan
from jserve.engine.request import RUNNING, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies import POLICIES
from jserve.policies.apt_greedy import refined_to_kv


READINGS = ("hidden_fallback", "count_late", "skip")  # AptServePolicy's, off by default


class CountedPolicy:
    """A policy, unchanged, with a count of its hidden-cache decisions."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.chunked_prefill = inner, inner.name, inner.chunked_prefill
        self.capabilities = inner.capabilities
        self.counts: collections.Counter[str] = collections.Counter()

    def schedule(self, view: SchedulerView) -> Plan:
        plan = self.inner.schedule(view)
        r, c = view.requests, self.counts
        hidden_running = (r.status == RUNNING) & (request_types(view) == CacheType.HIDDEN)
        waiting = r.with_status(WAITING)
        kv_by_rule = dict(zip(r.seq_id[waiting].tolist(), refined_to_kv(
            self.inner.candidates(view, waiting, r.num_tokens[waiting]), self.inner.penalty(view)).tolist()))
        types = cache_types(plan)
        for i, seq in enumerate(r.seq_id.tolist()):
            to_kv = types.get(seq) == CacheType.KV
            if r.status[i] == WAITING and seq in plan.run:
                hidden = types.get(seq) == CacheType.HIDDEN
                c["admitted on hidden" if hidden else "admitted on KV"] += 1
                c["admitted on hidden, the refinement's choice KV (only the hidden half fit)"] += hidden and kv_by_rule[seq]
            elif hidden_running[i]:
                c["hidden running: " + ("moved to KV by preemption" if seq in plan.preempt and to_kv else
                                         "left out (preempted)" if seq in plan.preempt else
                                         "moved to KV in the same step" if seq in plan.run and to_kv else
                                         "kept on hidden, decoding" if seq in plan.run else "idle")] += 1
        c["plans"] += 1
        c["plans with a hidden request running"] += bool(hidden_running.any())
        return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost-model", default="apt-serve")
    ap.add_argument("--policy", default="apt-serve")
    ap.add_argument("--workload", default="sharegpt", choices=("sharegpt", "longbench-filtered"))
    ap.add_argument("--rate", type=float, default=3.5)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--readings", default="", help="our readings to switch on, comma-separated, of " + ", ".join(READINGS))
    args = ap.parse_args()
    readings = [x for x in args.readings.split(",") if x]
    if unknown := set(readings) - set(READINGS):
        ap.error(f"unknown readings {sorted(unknown)}; choose from {', '.join(READINGS)}")
    counted = CountedPolicy(dataclasses.replace(POLICIES[args.policy](), **dict.fromkeys(readings, True)))
    POLICIES[f"{args.policy}+counted"] = lambda: counted  # a benchmark names its policy
    engine = EngineConfig(runner="sim", model="opt-13b", hardware="a100-40g", policy=f"{args.policy}+counted",
                          max_model_len=2048, block_size=16, cost_model=args.cost_model)
    ttft, tbt = (1.0, 1.0) if args.workload == "sharegpt" else (4.0, 1.0)  # Table 3, 13B
    result = run_benchmark(BenchConfig(engine, workload=args.workload, rate=args.rate, num_requests=args.requests,
                                       seed=0, ttft_slo=ttft, tbt_slo=tbt), progress=False)
    print(f"{args.policy}{' with ' + ', '.join(readings) if readings else ''} on {args.cost_model}, {args.workload} at {args.rate:g} req/s, {args.requests} requests: "
          f"SLO attainment {result.summary.slo_attainment:.1%}, {result.num_preemptions} preemptions")
    for key, n in sorted(counted.counts.items()):
        print(f"  {key}: {n}")


if __name__ == "__main__":
    main()
