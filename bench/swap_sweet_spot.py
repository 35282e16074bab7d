#!/usr/bin/env python
"""CacheOpt's swap-vs-recompute sweet spot (paper Section 3.5, Figure 8), done as the paper
does it: profile recompute and swap (out and back in) latency over sequence lengths, fit
`L_r` (quadratic) and `L_s` (linear), solve `L_r = L_s`.

- OPT-13B on A100-80G and A100-40G from the simulator's cost model (`RooflineCostModel`,
  vLLM v0's block-by-block swap copies), at the paper's two block sizes (Section 2: 32, where
  Figure 8 was measured; Section 5: 8) and vLLM's default 16.
- SmolLM2-135M on this CPU, measured through the JAX runner: recompute = a prefill step of
  S tokens, swap = S tokens' blocks out to host memory and back in (the engine's own path).

Prints both fits and the sweet spots beside the paper's ~4k tokens, with what a sweet spot
means against OPT-13B's 2,048-token context; writes bench/results/swap_sweet_spot.json/.md.

    python bench/swap_sweet_spot.py [--cpu-sizes 16 32 64 128 256 512 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
from typing import Any, cast

import numpy as np

from jserve.cache.sizing import block_bytes
from jserve.benchmarking.tables import markdown_head, markdown_row
from jserve.engine.preemption_costs import PreemptionCosts, SweetSpot
from jserve.runners.cost_model import RooflineCostModel, SwapPath, recompute_time
from jserve.runners.hardware import get_hardware
from jserve.runners.preemption_cost import PreemptionProfile, profile_cost_model
from jserve.models.registry import get_config

RESULTS = pathlib.Path(__file__).parent / "results"
PAPER_SWEET_SPOT = 4000  # Section 2.5 / Figure 8: swapping is faster past about 4k tokens
OPT13B_CONTEXT = 2048  # OPT's max_position_embeddings; the paper cuts BookCorpus prompts to it
CPU_BLOCK_SIZE = 16


def row(label: str, profile: PreemptionProfile, context: int, kv_bytes_per_token: int) -> dict[str, Any]:
    costs = profile.fit()
    spot = costs.solve()
    s = np.asarray(profile.sizes, np.float64)
    err_r = np.array([costs.recompute(n) for n in s]) / np.asarray(profile.recompute_s) - 1
    err_s = np.array([costs.swap(n) for n in s]) / np.asarray(profile.swap_s) - 1
    return {"setting": label, "profile": profile.to_dict(), "fit": vars(costs),
            "fit_max_rel_error": {"recompute": float(np.abs(err_r).max()), "swap": float(np.abs(err_s).max())},
            "sweet_spot": {"kind": spot.kind, "tokens": spot.tokens},
            "within_profile": spot.kind != "crossing" or spot.tokens <= max(profile.sizes),
            "profile_swap_faster_at": [n for n, r, w in zip(profile.sizes, profile.recompute_s, profile.swap_s) if w < r],
            "context": context, "meaning": meaning(spot, costs, context),
            # the K/V of the longest profiled request, out and in, over its swap time
            "effective_swap_gb_s": 2 * max(profile.sizes) * kv_bytes_per_token / max(profile.swap_s) / 1e9}


def meaning(spot: SweetSpot, costs: PreemptionCosts, context: int) -> str:
    """What the threshold does to requests that fit the model's context."""
    if spot.kind == "always" or spot.tokens <= 1:
        return "every preempted request swaps"
    if spot.tokens > context:
        exact = [n for n in range(1, context + 1) if costs.prefers_swap(n)]
        note = f" (swap is faster only below {max(exact) + 1} tokens)" if exact else ""
        return f"past the {context}-token context: every request recomputes{note}"
    return f"requests of >= {spot.tokens} cached tokens swap, shorter ones recompute"


def cost_model_rows() -> list[dict[str, Any]]:
    cfg = get_config("opt-13b")
    rows = []
    for hw in ("a100-80g", "a100-40g"):
        model = RooflineCostModel(cfg, get_hardware(hw), swap_path=SwapPath.PER_BLOCK_LAYER)
        for bs in (32, 16, 8):
            profile = profile_cost_model(model, bs, block_bytes(cfg, bs, 2))
            rows.append(row(f"OPT-13B, {hw}, block {bs}, cost model (vLLM v0 swap)", profile, OPT13B_CONTEXT,
                            cfg.kv_bytes_per_token))
        # The swap rate at which swapping 4k tokens out and in takes as long as recomputing
        # them on this model: what the paper's Figure 8 crossing implies.
        implied = 2 * PAPER_SWEET_SPOT * cfg.kv_bytes_per_token / recompute_time(model, PAPER_SWEET_SPOT)
        for r in rows[-3:]:
            r["paper_implied_swap_gb_s"] = implied / 1e9
    return rows


def latency_sensitivity() -> list[dict[str, Any]]:
    """The OPT-13B sweet spots across DualPath's 5-7 us per copy call (hardware.py)."""
    cfg = get_config("opt-13b")
    out = []
    for hw in ("a100-80g", "a100-40g"):
        for latency in (5e-6, 6e-6, 7e-6):
            model = RooflineCostModel(cfg, dataclasses.replace(get_hardware(hw), copy_latency=latency))
            spots = {bs: profile_cost_model(model, bs, block_bytes(cfg, bs, 2)).fit().solve() for bs in (32, 16, 8)}
            out.append({"hardware": hw, "copy_latency_us": latency * 1e6,
                        "sweet_spot_by_block": {bs: {"kind": sp.kind, "tokens": sp.tokens} for bs, sp in spots.items()}})
    return out


def describe_sensitivity(rows: list[dict[str, Any]]) -> str:
    lines = ["OPT-13B sweet spot vs the per-copy latency (block 32 / 16 / 8):"]
    for r in rows:
        spots = [SweetSpot(v["kind"], v["tokens"]).describe() for v in r["sweet_spot_by_block"].values()]
        lines.append(f"  {r['hardware']}, {r['copy_latency_us']:.0f} us: " + " / ".join(spots))
    return "\n".join(lines)


def cpu_row(sizes: list[int], repeats: int) -> dict[str, Any]:
    import jax

    from jserve.builder import build_engine
    from jserve.config import EngineConfig
    from jserve.runners.jax_runner import JaxRunner
    from jserve.runners.profiling import measure_preemption

    top = max(sizes)
    config = EngineConfig(model="smollm2-135m", block_size=CPU_BLOCK_SIZE, max_model_len=top,
                          max_num_batched_tokens=top, max_num_seqs=8, num_blocks=2 * -(-top // CPU_BLOCK_SIZE) + 8,
                          warmup=False)
    built = build_engine(config)
    runner = cast(JaxRunner, built.runner)
    profile = measure_preemption(runner, sizes, repeats)
    context = built.model_config.max_position
    device = f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}"
    kv = block_bytes(built.model_config, 1, runner.cache.k.dtype.itemsize)
    return row(f"SmolLM2-135M, {device}, block {CPU_BLOCK_SIZE}, measured (JAX runner)", profile, context, kv)


def describe(r: dict[str, Any]) -> str:
    f, p = r["fit"], r["profile"]
    spot = SweetSpot(r["sweet_spot"]["kind"], r["sweet_spot"]["tokens"])
    lines = [r["setting"],
             (f"  L_r(S) = {f['a']:.3e}*S^{f['b']:g} + {f['k']:.3e}*S + {f['e']:.3e} s"
              f"   (max rel. error {r['fit_max_rel_error']['recompute']:.1%})"),
             (f"  L_s(S) = {f['g']:.3e}*S + {f['d']:.3e} s"
              f"   (max rel. error {r['fit_max_rel_error']['swap']:.1%})"),
             "  S      " + " ".join(f"{n:>8d}" for n in p["sizes"]),
             "  rec ms " + " ".join(f"{t * 1e3:8.2f}" for t in p["recompute_s"]),
             "  swap ms" + " ".join(f"{t * 1e3:8.2f}" for t in p["swap_s"]),
             f"  sweet spot: {spot.describe()}"
             + ("" if r["within_profile"] else " [extrapolated past the profiled lengths]")
             + f"; paper (Figure 8): ~{PAPER_SWEET_SPOT} tokens",
             f"  profile itself: swap faster at S = {r['profile_swap_faster_at'] or 'none'}",
             f"  effective swap rate (out + in bytes / time) at S = {max(p['sizes'])}: "
             f"{r['effective_swap_gb_s']:.1f} GB/s"
             + (f"; the paper's 4k crossing would need {r['paper_implied_swap_gb_s']:.1f} GB/s on this model"
                if "paper_implied_swap_gb_s" in r else ""),
             f"  with a {r['context']}-token context: {r['meaning']}"]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["# CacheOpt swap-vs-recompute sweet spot", "",
           ("Written by `python bench/swap_sweet_spot.py`. `L_r(S) = a*S^2 + k*S + e`, "
            "`L_s(S) = g*S + d` (seconds; swap = out and back in), fitted to the profile; the "
            f"paper's Figure 8 puts the crossing at about {PAPER_SWEET_SPOT} tokens (OPT-13B, A100, "
            f"block 32). OPT-13B's context is {OPT13B_CONTEXT} tokens."), "",
           *markdown_head(["setting", "a", "k", "e", "g", "d", "sweet spot", "in profiled range",
                           "profile: swap faster at S =", "swap GB/s (paper's 4k needs)", "with the model's context"])]
    for r in rows:
        f = r["fit"]
        spot = SweetSpot(r["sweet_spot"]["kind"], r["sweet_spot"]["tokens"])
        out.append(markdown_row([
            r["setting"], *(f"{f[k]:.2e}" for k in "akegd"), spot.describe(), "yes" if r["within_profile"] else "no",
            ", ".join(map(str, r["profile_swap_faster_at"])) or "none",
            f"{r['effective_swap_gb_s']:.1f}"
            + (f" ({r['paper_implied_swap_gb_s']:.1f})" if "paper_implied_swap_gb_s" in r else ""),
            r["meaning"]]))
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cpu", action="store_true", help="only the cost-model rows")
    ap.add_argument("--output", default=str(RESULTS / "swap_sweet_spot.json"))
    args = ap.parse_args()
    rows = cost_model_rows()
    if not args.skip_cpu:
        rows.append(cpu_row(args.cpu_sizes, args.repeats))
    for r in rows:
        print(describe(r), end="\n\n")
    sensitivity = latency_sensitivity()
    print(describe_sensitivity(sensitivity), end="\n\n")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "paper_sweet_spot": PAPER_SWEET_SPOT,
                               "opt13b_context": OPT13B_CONTEXT, "rows": rows,
                               "copy_latency_sensitivity": sensitivity}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows) + "\n```\n" + describe_sensitivity(sensitivity) + "\n```\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
