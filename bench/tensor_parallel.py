#!/usr/bin/env python
"""Real-engine step time over 1, 2 and 4 devices, beside the cost model's prediction, in one run.

On this machine the devices are forced CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set here before JAX starts): they are
threads of one process sharing the same cores and memory, so splitting a step over them
adds all-reduces (memcpys here) and buys no compute or bandwidth. **No speedup is expected
on CPU**; the figures show what tensor parallelism costs in overhead on the real engine
(the step compiled over a mesh, attention per shard, 2 all-reduces a layer), and that its
greedy ids equal one device's.

Beside them: the simulator's cost model (`builder.sim_cost_model`, the roofline of a GPU
entry for one GPU of a tensor-parallel group: work, weights and KV split over the group,
two ring all-reduces a layer over the entry's interconnect) for the same model and the same
steps (`StepShape.of` each measured batch), on an A100-80G group (NVLink) and an L20 group
(PCIe only), in bfloat16. They are what the GPUs would take, not a prediction of this CPU.

The model is a Llama of ~50M parameters with dummy weights (GQA: 12 heads, 4 KV heads,
so 2 and 4 devices split KV heads without repeats), float32, a vllm schedule of 16
requests of 256-token prompts and 16 output tokens at 512 batched tokens a step: its
prefill steps are 512 tokens (two prompts), its decode steps 16 sequences. Each size
serves the requests twice; the second pass is timed (the first compiles).

Usage::

    python bench/tensor_parallel.py     # writes bench/results/tensor_parallel_cpu.json and .md
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jserve import LLM, SamplingParams
from jserve.builder import sim_cost_model
from jserve.config import EngineConfig
from jserve.engine.batch import Batch, StepOutput
from jserve.runners.cost_model import StepShape
from jserve.models.llama import LlamaForCausalLM
from jserve.models.loading import LoadedModel
from jserve.models.registry import MODELS, get_config

SIZES = (1, 2, 4)
GPUS = ("a100-80g", "l20")
MODEL = dataclasses.replace(get_config("tiny-llama"), name="bench-tp-llama", vocab_size=8192,
                            hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=4,
                            head_dim=64, intermediate_size=2048)
OUT = pathlib.Path(__file__).resolve().parent / "results" / "tensor_parallel_cpu.json"


class TimedRunner:
    """The engine's runner, each `execute` timed (its outputs are numpy: the step is done)."""

    def __init__(self, runner) -> None:
        self.runner, self.needs_inputs, self.steps = runner, runner.needs_inputs, []

    def execute(self, batch: Batch) -> StepOutput:
        t0 = time.perf_counter()
        out = self.runner.execute(batch)
        self.steps.append((StepShape.of(batch), time.perf_counter() - t0))
        return out


def serve(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def kind(shape: StepShape) -> str | None:
    if shape.num_prefill_tokens and not shape.num_decode_tokens:
        return f"prefill {shape.num_prefill_tokens}"
    if shape.num_decode_tokens and not shape.num_prefill_tokens:
        return f"decode x{shape.num_decode_tokens}"
    return None


def measure(loaded: LoadedModel, tp: int, args) -> tuple[dict, list[list[int]]]:
    llm = LLM(loaded, tensor_parallel_size=tp, num_blocks=args.requests * 20, max_num_seqs=args.requests,
              max_model_len=2 * args.prompt_len, max_num_batched_tokens=2 * args.prompt_len, warmup=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, MODEL.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    serve(llm, prompts, args.output_len)  # compiles every bucket this load meets
    timed = llm.engine.runner = TimedRunner(llm.engine.runner)
    ids = serve(llm, prompts, args.output_len)
    costs = {gpu: sim_cost_model(EngineConfig(model=MODEL.name, runner="sim", hardware=gpu,
                                              tensor_parallel_size=tp)) for gpu in GPUS}
    by_kind: dict[str, list[tuple[StepShape, float]]] = {}
    for shape, seconds in timed.steps:
        if (k := kind(shape)) is not None:
            by_kind.setdefault(k, []).append((shape, seconds))
    # The most frequent prefill and decode steps (full token budget, every request decoding).
    rows = {}
    for k, steps in by_kind.items():
        group = max((s for s in by_kind if s.split()[0] == k.split()[0]), key=lambda s: len(by_kind[s]))
        if k != group:
            continue
        rows[k] = {"steps": len(steps), "measured_ms": 1e3 * float(np.median([t for _, t in steps])),
                   **{f"{gpu}_ms": 1e3 * float(np.median([cost.step_time(s) for s, _ in steps]))
                      for gpu, cost in costs.items()},
                   **{f"{gpu}_allreduce_ms": 1e3 * float(np.median([cost.breakdown(s)["allreduce"] for s, _ in steps]))
                      for gpu, cost in costs.items()}}
    return rows, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    MODELS[MODEL.name] = MODEL  # the cost model reads the shape by name
    model = LlamaForCausalLM(MODEL, dtype=jnp.float32, rngs=nnx.Rngs(0))
    loaded = LoadedModel(MODEL, model, None)
    print(f"{MODEL.name}: {MODEL.num_params / 1e6:.0f}M parameters, {MODEL.num_layers} layers, "
          f"{MODEL.num_heads} heads / {MODEL.num_kv_heads} KV heads; {jax.device_count()} "
          f"{jax.devices()[0].platform.upper()} devices on {os.cpu_count()} cores")
    print("CPU devices share this machine's cores and memory: no speedup is expected from more "
          "of them; the GPU columns are the cost model's prediction for the same steps on those "
          "GPUs (bfloat16), not of this CPU.\n")
    results, reference = {}, None
    for tp in SIZES:
        rows, ids = measure(loaded, tp, args)
        reference = reference or ids
        results[tp] = {"rows": rows, "greedy_identical_to_tp1": ids == reference}
    kinds = sorted({k for r in results.values() for k in r["rows"]})
    lines = ["| step | devices | CPU ms (measured) | vs 1 device | " + " | ".join(
        f"{gpu} ms predicted (all-reduce)" for gpu in GPUS) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(GPUS)]
    for k in kinds:
        base = results[1]["rows"][k]["measured_ms"]
        for tp in SIZES:
            r = results[tp]["rows"][k]
            gpus = " | ".join(f"{r[f'{gpu}_ms']:.2f} ({r[f'{gpu}_allreduce_ms']:.2f})" for gpu in GPUS)
            lines.append(f"| {k} | {tp} | {r['measured_ms']:.1f} | {r['measured_ms'] / base:.2f}x | {gpus} |")
    same = {tp: r["greedy_identical_to_tp1"] for tp, r in results.items()}
    lines.append(f"\ngreedy ids identical to 1 device: {same}")
    print("\n".join(lines))
    OUT.with_suffix(".md").write_text(
        "# Tensor parallelism on the real engine (CPU, forced devices)\n\n`python bench/tensor_parallel.py`; "
        "the devices are forced CPU devices sharing one machine's cores, so no speedup is expected; "
        "the GPU columns are the simulator's cost model for the same steps on those GPUs.\n\n"
        + "\n".join(lines) + "\n")
    OUT.write_text(json.dumps({"model": dataclasses.asdict(MODEL), "args": vars(args),
                               "devices": jax.device_count(), "cores": os.cpu_count(),
                               "results": results}, indent=1))
    print(f"wrote {OUT} and its .md")


if __name__ == "__main__":
    main()
