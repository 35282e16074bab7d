#!/usr/bin/env python
"""How many ShareGPT requests per second one A100-80G can serve OPT-13B at all: the bound
behind reading CacheOpt's Table 1 rate (28 req/s) as an overload point.

Every decode step of a request reads that request's whole K/V so far, so a request with a
p-token prompt and o output tokens reads sum_{k=0}^{o-2} (p + k) tokens' K/V over its o - 1
decode steps (the first token comes from the prefill). Nothing another request does can
lower that, so HBM bandwidth / (those bytes) bounds the rate even with unlimited memory
and free weights (bound 1). With the cache as large as vLLM sizes it on the card, a step
also reads the weights once and at most the whole cache, and the batch it advances is at
most the cache over a request's time-mean context; that bounds the tokens per second, and
divided by the mean output the rate (bound 2). Both are printed at the datasheet bandwidth
and at the measured fractions of it (`published_a100.json`'s `kv_mbu`, `weight_mbu`: what
the calibrated simulator uses), for Table 1's mean lengths and for the ShareGPT sample our
reproduction replays (per request, not from its means).

    python bench/cacheopt_bound.py        # a second; writes bench/results/cacheopt_bound.json
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jserve.benchmarking.workload import build_trace
from jserve.config import EngineConfig
from jserve.runners.cost_model import RooflineCostModel
from jserve.runners.hardware import get_hardware
from jserve.runners.measured_cost import published_fit

RESULTS = pathlib.Path(__file__).parent / "results"
TABLE1_SHAREGPT = (161.31, 337.99)  # mean input, mean output tokens (CacheOpt, Table 1)
TABLE1_RATE = 28.0  # req/s, Table 1's ShareGPT rate for OPT-13B on one A100-80G


def kv_tokens_read(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Tokens of K/V a request reads over its decode steps: sum_{k=0}^{o-2} (p + k)."""
    steps = np.maximum(output - 1, 0)
    return steps * prompt + steps * (steps - 1) / 2.0


def mean_context(prompt: np.ndarray, output: np.ndarray) -> float:
    """A decode slot's time-mean context: K/V tokens read per decode step, over all steps."""
    return float(kv_tokens_read(prompt, output).sum() / np.maximum(output - 1, 0).sum())


def bounds(prompt: np.ndarray, output: np.ndarray, kv_bytes_per_token: float, weight_bytes: float,
           cache_tokens: int, hbm: float, kv_mbu: float, weight_mbu: float) -> dict:
    """Bound 1 (K/V reads alone) and bound 2 (with the weights and the cache's size), req/s."""
    per_request = float(kv_tokens_read(prompt, output).mean() * kv_bytes_per_token)
    batch = cache_tokens / mean_context(prompt, output)
    step = weight_bytes / (hbm * weight_mbu) + cache_tokens * kv_bytes_per_token / (hbm * kv_mbu)
    return {"kv_bytes_per_request": per_request, "reads_per_request": float(np.maximum(output - 1, 0).mean()),
            "bound_kv_only": hbm * kv_mbu / per_request, "max_batch": batch, "full_cache_step_s": step,
            "bound_with_cache": batch / step / float(output.mean())}


def main() -> None:
    cfg = EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g", block_size=8)
    model, hw = cfg.model_config(), get_hardware(cfg.hardware)
    roof = RooflineCostModel(model, hw)
    cache_tokens = cfg.sim_kv_blocks() * cfg.block_size
    kernels = published_fit().kernels
    trace = build_trace("sharegpt", 1000, 1.0, seed=0)
    shapes = {"Table 1 means": (np.array([TABLE1_SHAREGPT[0]]), np.array([TABLE1_SHAREGPT[1]])),
              "our ShareGPT sample (1,000, seed 0)": (np.array([r.prompt_len for r in trace.requests], float),
                                                       np.array([r.output_len for r in trace.requests], float))}
    effs = {"datasheet (mbu 1.0)": (1.0, 1.0), "roofline (mbu 0.8)": (hw.mbu, hw.mbu),
            "measured (kv_mbu %.3f, weight_mbu %.3f)" % (kernels.kv_mbu, kernels.weight_mbu):
                (kernels.kv_mbu, kernels.weight_mbu)}
    print(f"OPT-13B on one A100-80G: K/V {roof.kv_bytes_per_token / 1e6:.3f} MB per token, weights "
          f"{roof.weight_bytes / 1e9:.1f} GB, HBM {hw.hbm_bandwidth / 1e12:.3f} TB/s, cache "
          f"{cache_tokens:,} tokens ({cache_tokens * roof.kv_bytes_per_token / 1e9:.1f} GB, as vLLM sizes it at "
          f"gpu_memory_utilization {cfg.gpu_memory_utilization})")
    out = {"kv_bytes_per_token": roof.kv_bytes_per_token, "weight_bytes": roof.weight_bytes,
           "hbm_bandwidth": hw.hbm_bandwidth, "cache_tokens": cache_tokens, "table1_rate": TABLE1_RATE, "rows": []}
    for shape, (p, o) in shapes.items():
        print(f"\n{shape}: input {p.mean():.1f}, output {o.mean():.1f} tokens; each request reads its own "
              f"K/V {np.maximum(o - 1, 0).mean():.0f} times, {kv_tokens_read(p, o).mean() * roof.kv_bytes_per_token / 1e9:.1f} GB")
        for eff, (kv, w) in effs.items():
            b = bounds(p, o, roof.kv_bytes_per_token, roof.weight_bytes, cache_tokens, hw.hbm_bandwidth, kv, w)
            out["rows"].append({"shape": shape, "efficiency": eff, **b})
            print(f"  {eff:<40} K/V reads only: {b['bound_kv_only']:5.1f} req/s "
                  f"(Table 1's 28 = {TABLE1_RATE / b['bound_kv_only']:.2f}x); with weights and the cache's "
                  f"size (batch <= {b['max_batch']:.0f}, step {b['full_cache_step_s'] * 1e3:.0f} ms): "
                  f"{b['bound_with_cache']:5.1f} req/s ({TABLE1_RATE / b['bound_with_cache']:.2f}x)")
    path = RESULTS / "cacheopt_bound.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
