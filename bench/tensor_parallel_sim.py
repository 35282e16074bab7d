#!/usr/bin/env python
"""Tensor parallelism in the simulator: the papers' multi-GPU settings under vLLM, their step
times beside the bandwidth bound and a published measurement where one exists.

Settings (issue 17):
- OPT-175B on 8 A100-80G SXM with NVLink 3 (CacheOpt's setting, AWS p4d.24xlarge; the
  vLLM paper's too), `--tensor-parallel-size 8`;
- Llama-3.1-70B on 4 L20 with PCIe only, two GPUs per host link (LayerKV's testbed,
  Section 5.1), `--tensor-parallel-size 4`.

For each, printed: (1) the cost model's step time for decode batches and prefills with its
terms (`--cost-model`, the simulator's default unless given: its kernels, or the roofline's
compute and memory, then all-reduce and overhead), beside the decode step's hard floor, every GPU
streaming its weight shard once at the datasheet's peak HBM bandwidth
(`weights / (tp * hbm)`), (2) a ShareGPT run under `vllm` at two rates: mean TPOT, median
ITL (a decode step with its batch), mean TTFT, and the KV blocks the group holds, and (3)
for the L20 group, two LayerKV steps priced with the all-reduces sharing PCIe with the layer
copies (LayerKV Section 3.1.3: copies wait while an all-reduce runs) and, for comparison,
on a link of the same speed of their own (what NVLink would give): a long prefill writing
its K/V to host, whose copies hide under the compute either way, and a big decode step
bringing a long request's layers back, which is copy-bound and pays for the waits (these two
on the roofline, whose terms the link contention changes).

Published measurements: none found. We searched the docs and pages corpora for vLLM on
OPT-175B / 8 x A100-80G and on Llama-3.1-70B / 4 x L20 (step time, TPOT or ITL). The vLLM
paper (Kwon et al., SOSP 2023) and CacheOpt run OPT-175B on 8 A100s but publish normalised
latency and times per request in figures, not step times; the LayerKV paper's 70B results
(Figures 4-5) are images whose values its text does not state. The comparison is therefore
with the bandwidth floor: a decode step must take longer than it, and vLLM's decode steps
are usually within 1.2-2x of it at small batches (the table's terms show what separates them here).

Usage:
    python bench/tensor_parallel_sim.py            # ~1 min on 2 cores
Writes bench/results/tensor_parallel_sim.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import pathlib
from contextlib import redirect_stdout

from jserve.benchmarking.bench import BenchConfig
from jserve.benchmarking.sweep import run_points
from jserve.benchmarking.tables import cell, markdown_table
from jserve.builder import sim_cost_model
from jserve.config import EngineConfig
from jserve.cache_features.layer_offload.batch import LayerTraffic
from jserve.runners.cost_model import RooflineCostModel, StepShape
from jserve.runners.hardware import get_hardware
from jserve.runners.testbeds import COST_MODELS, DEFAULT_COST_MODEL
from jserve.models.registry import get_config

SETTINGS = (("opt-175b", "a100-80g", 8), ("llama-3.1-70b", "l20", 4))
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXT = 1024
PREFILLS = (512, 2048)
RATES = (0.5, 2.0)
CONTENTION_SETTING = "llama-3.1-70b on 4 x l20"
RESULTS = pathlib.Path(__file__).parent / "results"


def engine(model: str, hardware: str, tp: int, cost_model: str) -> EngineConfig:
    return EngineConfig(runner="sim", model=model, hardware=hardware, tensor_parallel_size=tp,
                        policy="vllm", cost_model=cost_model)


def step_rows(model: str, hardware: str, tp: int, cost_model: str) -> list[dict]:
    """The cost model's step time and terms for decode batches and lone prefills."""
    cost = sim_cost_model(engine(model, hardware, tp, cost_model))
    assert isinstance(cost, RooflineCostModel)
    cfg, hw = get_config(model), get_hardware(hardware)
    floor = cfg.num_params * 2 / (tp * hw.hbm_bandwidth)
    shapes = [(f"decode x{b} @ {DECODE_CONTEXT}", StepShape.decode([DECODE_CONTEXT] * b), floor)
              for b in DECODE_BATCHES]
    shapes += [(f"prefill {n}", StepShape.prefill(n), None) for n in PREFILLS]
    return [{"step": name, "ms": 1e3 * cost.step_time(shape),
             **{k: 1e3 * v for k, v in cost.breakdown(shape).items()},
             "bandwidth_floor_ms": None if f is None else 1e3 * f} for name, shape, f in shapes]


def contention_rows(model: str, hardware: str, tp: int) -> list[dict]:
    """LayerKV steps priced with the all-reduces on the host link (PCIe, as on the L20
    server) and on a separate link of the same speed (as NVLink would be): a long prefill
    writing every layer's K/V to host, and a big decode step that brings one long request's
    layers back."""
    cfg, hw = get_config(model), get_hardware(hardware)
    per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    zeros = (0,) * cfg.num_layers

    def moving(tokens: int, direction: str) -> LayerTraffic:
        moved = (tokens * per_token_layer,) * cfg.num_layers
        return LayerTraffic(moved if direction == "out" else zeros, zeros,
                            moved if direction == "in" else zeros, zeros)

    cases = [("prefill 8192, its K/V written to host", StepShape.prefill(8192), moving(8192, "out")),
             ("decode x256 @ 1024, one 32k-token request's layers brought back",
              StepShape.decode([DECODE_CONTEXT] * 256), moving(32768, "in"))]
    separate = dataclasses.replace(hw, interconnect=dataclasses.replace(hw.interconnect, kind="nvlink"))
    shared, own = (RooflineCostModel(cfg, h, tensor_parallel=tp) for h in (hw, separate))
    return [{"step": name, "without_copies_ms": 1e3 * shared.step_time(shape),
             "link_separate_ms": 1e3 * own.step_time(dataclasses.replace(shape, layer_bytes=moves)),
             "link_shared_ms": 1e3 * shared.step_time(dataclasses.replace(shape, layer_bytes=moves))}
            for name, shape, moves in cases]


def serving_rows(requests: int, cost_model: str) -> list[dict]:
    configs = [BenchConfig(engine(m, h, tp, cost_model), workload="sharegpt", rate=r, num_requests=requests)
               for m, h, tp in SETTINGS for r in RATES]
    rows = []
    for cfg, res in zip(configs, run_points(configs)):
        v, s = res.vllm, res.summary
        rows.append({"model": cfg.engine.model_name, "hardware": cfg.engine.hardware,
                     "tp": cfg.engine.tensor_parallel_size, "rate": cfg.rate,
                     "kv_blocks": res.num_blocks, "mean_tpot_ms": v["mean_tpot_ms"],
                     "median_itl_ms": v["median_itl_ms"], "mean_ttft_ms": v["mean_ttft_ms"],
                     "finished": s.num_finished, "preemptions": s.num_preemptions})
    return rows


def numbers(columns: int) -> list[str]:
    """A label column, then right-aligned figures."""
    return ["---"] + ["---:"] * (columns - 1)


def report(steps: dict, serving: list[dict], contention: dict, cost_model: str) -> None:
    for (model, hardware, tp) in SETTINGS:
        key = f"{model} on {tp} x {hardware}"
        hw = get_hardware(hardware)
        print(f"\n## {key} ({hw.interconnect.kind}, {hw.interconnect.bandwidth / 1e9:.0f} GB/s a "
              f"direction per GPU; cost model {cost_model}; published vLLM step time: none found)\n")
        rows = steps[key]
        terms = [k for k in rows[0] if k not in ("step", "ms", "bandwidth_floor_ms") and any(r[k] for r in rows)]
        print("\n".join(markdown_table(
            ["step", "predicted ms", *terms, "bandwidth floor ms"],
            ([r["step"], *(f"{r[k]:.1f}" for k in ("ms", *terms)), cell(r["bandwidth_floor_ms"], ".1f", "")]
             for r in rows), numbers(len(terms) + 3))))
    print(f"\n## ShareGPT under vllm (simulated, cost model {cost_model})\n")
    print("\n".join(markdown_table(
        ["setting", "rate req/s", "KV blocks", "mean TPOT ms", "median ITL ms", "mean TTFT ms", "finished",
         "preemptions"],
        ([f"{r['model']} / {r['tp']} x {r['hardware']}", r["rate"], r["kv_blocks"], f"{r['mean_tpot_ms']:.1f}",
          f"{r['median_itl_ms']:.1f}", f"{r['mean_ttft_ms']:.0f}", r["finished"], r["preemptions"]]
         for r in serving), numbers(8))))
    print(f"\n## LayerKV's layer copies and the all-reduces on PCIe ({CONTENTION_SETTING}, roofline)\n")
    print("\n".join(markdown_table(
        ["step", "without copies ms", "all-reduces on their own link ms", "on the copies' PCIe link ms"],
        ([r["step"], *(f"{r[k]:.1f}" for k in ("without_copies_ms", "link_separate_ms", "link_shared_ms"))]
         for r in contention), numbers(4))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="ShareGPT requests per run")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="how the simulator prices a step's GPU work (default: %(default)s)")
    args = ap.parse_args()
    steps = {f"{m} on {tp} x {h}": step_rows(m, h, tp, args.cost_model) for m, h, tp in SETTINGS}
    contention = contention_rows("llama-3.1-70b", "l20", 4)
    serving = serving_rows(args.requests, args.cost_model)
    out = io.StringIO()
    with redirect_stdout(out):
        report(steps, serving, contention, args.cost_model)
    print(out.getvalue())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_parallel_sim.json").write_text(json.dumps(
        {"steps": steps, "serving": serving, "contention": contention,
         "requests": args.requests, "rates": RATES, "cost_model": args.cost_model, "published": None}, indent=1))
    (RESULTS / "tensor_parallel_sim.md").write_text(
        "# Tensor parallelism in the simulator\n\n`python bench/tensor_parallel_sim.py`; see its "
        "docstring for the settings and why no published figure is beside ours.\n" + out.getvalue())


if __name__ == "__main__":
    main()
