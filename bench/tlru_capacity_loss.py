#!/usr/bin/env python
"""Why T-LRU lost to LRU at large capacities in jserve's first reproduction, measured.

Issue 14: on Llama-2-13B (simulated A100-80G), 400 closed-loop ShareGPT conversations
(birth-death think times), xi = 0.2 s, T-LRU was worse than LRU at 10,000 and 20,000 tokens
(P95 +17.3%, 200 ms violations +46% at 20,000) and cached 18-31% of prompt tokens against
LRU's 50-63%. That setting ran the earlier variants: xi turned into tokens by a line with an
intercept refitted online to recent TTFTs, Q_hat the running mean, and a capacity that
bounded only unreferenced blocks. This script runs the same setting under those variants
and under the paper's definitions (xi fitted once, through the origin, to the cost model's
prefills; Q_hat = 100; every cached block counted), and prints for each the xi in tokens
T-LRU planned with (the online fit's value at the end of the run), the share of prompt
tokens served from the cache and the TTFT tail. Both rules see the same schedule.

Usage: python bench/tlru_capacity_loss.py   (~5 min on 2 busy cores)
Writes bench/results/tlru_capacity_loss.json and .md.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import sys
import time

from jserve.benchmarking.bench import (
    BenchConfig,
    conversation_schedule,
    run_conversation_benchmark,
)
from jserve.benchmarking.conversations import run_conversations, synthetic_message_ids
from jserve.benchmarking.tables import markdown_head, markdown_row
from jserve.builder import build_engine
from jserve.cache.prefix import PrefixCacheConfig
from jserve.config import EngineConfig

RESULTS = pathlib.Path(__file__).parent / "results"
CAPACITIES = (10000, 20000)
XI = 0.2  # the first reproduction's; 0.1 (about LRU's P90 here) is run too, paper's definitions
XI_NEAR_P90 = 0.1
# The earlier jserve variants, and the paper's definitions (the defaults).
VARIANTS = {
    "earlier": dict(xi_fit="online", q_hat=None, capacity_counts="unreferenced", threshold_soft=True),
    "paper": {},
}


def _config(rule: str, cap: int, variant: str, xi: float = XI) -> BenchConfig:
    cache = PrefixCacheConfig(rule, cap, isolation=True, tel_threshold=xi, **VARIANTS[variant])
    engine = EngineConfig(runner="sim", model="llama-2-13b", hardware="a100-80g", max_model_len=4096,
                          prefix_cache=cache)
    return BenchConfig(engine, workload="sharegpt-multiturn", num_requests=400, rate=1.0, seed=0,
                       conversation_process="birth-death", turn_rate=0.1, end_rate=0.05)


def measure(rule: str, cap: int, variant: str, xi: float = XI) -> dict[str, float]:
    cfg = _config(rule, cap, variant, xi)
    result = run_conversation_benchmark(cfg, progress=False)
    m = result.multiturn or {}
    rule_obj = build_engine(cfg.engine).engine.eviction  # xi_tokens as the builder fixed it
    return {"ttft_p90": m["ttft_p90"], "ttft_p95": m["ttft_p95"], "ttft_p99": m["ttft_p99"],
            "slo_violation": m["slo_violation"], "tel": m["tel"],
            "cached_prompt_fraction": m["cached_prompt_fraction"],
            "xi_tokens": getattr(rule_obj, "xi_tokens", None)}


def online_xi_tokens(cap: int) -> tuple[float, float, float]:
    """The online fit (floor s, tokens/s) at the end of T-LRU's run under the earlier
    variants, and the xi in tokens it gives: (0.2 - floor) * rate."""
    cfg = _config("tlru", cap, "earlier")
    built = build_engine(cfg.engine)
    vocab = built.model_config.vocab_size
    run_conversations(built.engine, conversation_schedule(cfg), built.clock,
                      lambda cid, k, t: synthetic_message_ids(cid, k, t.new_tokens, vocab))
    floor, rate = built.engine.state._reuse.ttft_model()
    return floor, rate, max(XI - floor, 0.0) * rate


def main() -> int:
    t0 = time.perf_counter()
    todo = [(rule, cap, v, XI) for v in VARIANTS for cap in CAPACITIES for rule in ("lru", "tlru")]
    todo += [("tlru", cap, "paper", XI_NEAR_P90) for cap in CAPACITIES]
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        futs = {pool.submit(measure, *k): k for k in todo}
        online = {cap: pool.submit(online_xi_tokens, cap) for cap in CAPACITIES}
        res = {futs[f]: f.result() for f in concurrent.futures.as_completed(futs)}
        online_res = {cap: f.result() for cap, f in online.items()}
    lines = ["# T-LRU's large-capacity loss, measured",
             "Llama-2-13B on a simulated A100-80G, 400 closed-loop ShareGPT conversations (birth-death, "
             "1/s, turn rate 0.1/s, end rate 0.05/s), isolated caches, xi = 0.2 s; the earlier jserve "
             "variants vs the paper's definitions.",
             "TEL is measured at the xi T-LRU planned with (LRU's at 0.2 s).",
             *markdown_head(["variant", "capacity", "rule", "xi s", "xi tokens", "from cache", "P90 ms", "P95 ms",
                             "P99 ms", "> 200 ms", "TEL s"])]
    for v in VARIANTS:
        for cap in CAPACITIES:
            for rule, xi in (("lru", XI), ("tlru", XI), ("tlru", XI_NEAR_P90)):
                if (rule, cap, v, xi) not in res:
                    continue
                m = res[(rule, cap, v, xi)]
                tok = (f"{online_res[cap][2]:.0f} (online, at the end)" if v == "earlier" and rule == "tlru"
                       else "" if rule == "lru" else f"{m['xi_tokens']:.0f}")
                lines.append(markdown_row([v, f"{cap:,}", rule, xi, tok, f"{100 * m['cached_prompt_fraction']:.0f}%",
                                           *(f"{1000 * m[k]:.0f}" for k in ("ttft_p90", "ttft_p95", "ttft_p99")),
                                           f"{100 * m['slo_violation']:.1f}%", f"{m['tel']:.1f}"]))
    lines.append("\nOnline fit at the end of T-LRU's earlier-variant runs (floor s, tokens/s): "
                 + "; ".join(f"{cap:,}: {f:.3f} s, {r:.0f} tok/s" for cap, (f, r, _) in online_res.items()))
    text = "\n".join(lines)
    print(text)
    out = RESULTS / "tlru_capacity_loss.json"
    out.write_text(json.dumps({"runs": [{"rule": k[0], "capacity": k[1], "variant": k[2], "xi": k[3], **m}
                                        for k, m in res.items()],
                               "online_fit": {str(c): v for c, v in online_res.items()},
                               "wall_s": time.perf_counter() - t0}, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
