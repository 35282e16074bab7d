"""The simulator's step time as two named parts: the GPU's work and the serving stack's own
overhead (`jserve.runners.engine_overhead`), chosen by name, reported with each run, and
warning once when a run leaves what a term was fitted on."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.builder import sim_cost_model
from jserve.config import EngineConfig, add_engine_args, engine_config_from_args
from jserve.models.registry import get_config
from jserve.runners.cost_model import StepShape
from jserve.runners.engine_overhead import KERNELS_ONLY, FitRange, FitRangeWatch
from jserve.runners.hardware import get_hardware
from jserve.runners.measured_cost import MeasuredCostModel, engine_overhead, published_fit
from jserve.runners.testbeds import DEFAULT_ENGINE_OVERHEAD, ENGINE_OVERHEADS, make_cost_model

LLAMA7B, A100 = get_config("llama-2-7b"), get_hardware("a100-80g")


def model(engine: str, tp: int = 1, cfg=LLAMA7B) -> MeasuredCostModel:
    return make_cost_model("measured", cfg, A100, tensor_parallel=tp, engine_overhead=engine)


def test_a_step_is_the_gpus_work_plus_the_stacks_overhead() -> None:
    decode = StepShape.decode([600] * 64)
    bare = MeasuredCostModel(LLAMA7B, A100, kernels=published_fit().kernels, engine=KERNELS_ONLY)
    for name in ENGINE_OVERHEADS:
        cost, stack = model(name), engine_overhead(name)
        parts = cost.breakdown(decode)
        assert sum(parts.values()) == pytest.approx(cost.step_time(decode))
        assert parts["kernels"] == pytest.approx(stack.gpu_slowdown * bare.kernel_time(decode))
        assert parts["overhead"] == pytest.approx(stack.step + stack.per_seq * 64)
    # the same GPU work, different stacks: only the overhead differs
    online, offline = model("vllm-0.2.3-server"), model("vllm-0.4-offline")
    assert online.step_time(decode) - offline.step_time(decode) > 64 * 0.3e-3


def test_cuda_graphs_spare_decodes_their_launches_and_eager_stacks_pay_them() -> None:
    graphs, eager = model("vllm-0.5-server"), model("vllm-0.5-eager")
    decode, prefill = StepShape.decode([300] * 32), StepShape.prefill(512)
    assert graphs.launch_time(decode) == 0 < eager.launch_time(decode)
    assert eager.launch_time(decode) == pytest.approx(graphs.engine.eager_launch * graphs.kernel_launches(decode))
    # vLLM captures decodes only, up to its largest captured batch
    assert graphs.launch_time(prefill) > 0
    assert graphs.launch_time(StepShape.decode([300] * 257)) > 0


def test_workers_cost_each_step_only_under_tensor_parallelism() -> None:
    decode = StepShape.decode([500] * 16)
    stack = engine_overhead("vllm-0.2.3-offline")
    tp1, tp2 = model("vllm-0.2.3-offline"), model("vllm-0.2.3-offline", tp=2)
    assert tp1.overhead_time(decode) == pytest.approx(stack.step + 16 * stack.per_seq)
    assert stack.worker_step > 0
    assert tp2.overhead_time(decode) - tp1.overhead_time(decode) == pytest.approx(stack.worker_step)
    assert model("jserve", tp=2).engine.worker_step == 0  # one SPMD program, no workers to drive


def test_memory_bound_kernels_scale_with_the_gpus_bandwidth() -> None:
    """Element-wise kernels and decode attention are priced in bytes: on an H100 (3.35 TB/s)
    they take the A100-80GB's (2.04 TB/s) time over the bandwidths' ratio, less launches."""
    h100 = make_cost_model("measured", LLAMA7B, get_hardware("h100"), engine_overhead="vllm-0.4-offline")
    a100 = model("vllm-0.4-offline")
    shape = StepShape.decode([2000] * 128)
    ratio = get_hardware("h100").hbm_bandwidth / A100.hbm_bandwidth
    assert a100.kernel_time(shape) / h100.kernel_time(shape) == pytest.approx(ratio, rel=0.1)
    # the CPU's share does not scale with the GPU
    assert h100.overhead_time(shape) == a100.overhead_time(shape)


def test_a_stack_that_pads_prompts_computes_the_padding() -> None:
    batch = StepShape.from_lens([0, 0], [100, 1000])
    assert batch.padded_prefill_tokens == 2000
    padded, plain = model("vllm-0.2.3-offline"), model("vllm-0.4-offline")
    unpadded = dataclasses.replace(padded.engine, pads_prompts=False)
    flat = MeasuredCostModel(LLAMA7B, A100, kernels=published_fit().kernels, engine=unpadded)
    assert padded.kernel_time(batch) > flat.kernel_time(batch)
    assert plain.kernel_time(batch) < padded.kernel_time(batch)


def test_padding_is_charged_only_to_a_scheduler_that_pads() -> None:
    padded = sim_cost_model(EngineConfig(runner="sim", model="opt-13b", policy="vllm-0.2.3"))
    plain = sim_cost_model(EngineConfig(runner="sim", model="opt-13b", policy="vllm"))
    assert padded.engine.name == plain.engine.name == DEFAULT_ENGINE_OVERHEAD
    assert padded.engine.pads_prompts and not plain.engine.pads_prompts


def test_the_engine_overhead_is_chosen_by_name_and_checked() -> None:
    sim = EngineConfig(runner="sim", model="llama-2-7b", engine_overhead="vllm-0.4-offline")
    assert sim_cost_model(sim).engine.name == "vllm-0.4-offline"
    assert sim_cost_model(EngineConfig(runner="sim", model="llama-2-7b")).engine.name == DEFAULT_ENGINE_OVERHEAD
    mine = dataclasses.replace(engine_overhead("vllm-0.4-offline"), name="mine", per_seq=1e-3)
    custom = EngineConfig(runner="sim", model="llama-2-7b", engine_overhead=mine)
    assert sim_cost_model(custom).engine is mine and custom.to_dict()["engine_overhead"] == "mine"
    with pytest.raises(ValueError, match="engine_overhead.*nosuch"):
        EngineConfig(runner="sim", model="opt-13b", engine_overhead="nosuch")
    with pytest.raises(ValueError, match="testbed under vllm-0.5-eager"):
        EngineConfig(runner="sim", model="opt-13b", hardware="a100-40g", cost_model="apt-serve",
                     engine_overhead="vllm-0.4-offline")
    with pytest.raises(ValueError, match="--engine-overhead or --profile"):
        EngineConfig(runner="sim", model="opt-13b", engine_overhead="jserve", profile="p.json")
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser, benchmark=True)
    args = parser.parse_args(["--engine-overhead", "vllm-0.4-offline", "--model", "llama-2-7b"])
    assert engine_config_from_args(args).engine_overhead == "vllm-0.4-offline"


def test_a_run_names_its_stack_and_warns_once_beyond_a_fit(capsys) -> None:
    FitRangeWatch.warned.clear()
    logging.basicConfig()  # as orbax's absl logging does: the warning stays one plain line
    engine = EngineConfig(runner="sim", model="opt-13b", max_model_len=1024)
    for _ in range(2):
        result = run_benchmark(BenchConfig(engine=engine, workload="fixed:256:32", rate=float("inf"),
                                           num_requests=120, seed=0), progress=False)
    simulated = result.to_json()["simulated"]
    assert (simulated["gpu"], simulated["engine_overhead"]) == ("measured", DEFAULT_ENGINE_OVERHEAD)
    assert "vllm-0.2.3-server" in simulated["description"]
    lines = [line for line in capsys.readouterr().err.splitlines() if "vllm-0.2.3-server: CPU time" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: engine overhead") and "at most 66 sequences" in lines[0]


def test_fit_ranges_name_what_they_leave() -> None:
    r = FitRange(max_batch=128, max_context=4096, max_tokens=4096, tensor_parallel=(1, 2))
    assert r.beyond(128, 4096.0, 4096) is None
    assert "128 sequences" in r.beyond(129, 10.0, 129)
    assert "4096 tokens" in r.beyond(1, 5000.0, 1)
    assert r.beyond_tp(4) is not None and r.beyond_tp(2) is None
    assert FitRange.from_dict(r.to_dict()) == r
