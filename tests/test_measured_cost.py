"""The simulator's measured cost model ("vLLM as measured"): the shipped fit is the fit of the
published measurements, its terms behave as kernels do, replaying real vLLM runs stays
within the calibration's goal, and a paper's testbed keeps to its hardware."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

import numpy as np
import pytest

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.metrics import tpot, ttft
from jserve.benchmarking.published_fit import (
    fit_engine_to_runs,
    fit_kernels,
    read_profile_csv,
    fit_cpu_overhead,
)
from jserve.benchmarking.published_runs import distserve_engine, read_distserve_runs
from jserve.benchmarking.workload import save_trace
from jserve.config import EngineConfig
from jserve.models.registry import get_config
from jserve.runners.cost_model import StepShape
from jserve.runners.hardware import get_hardware
from jserve.runners.measured_cost import PUBLISHED, MeasuredCostModel, published_fit
from jserve.runners.testbeds import COST_MODELS, PAPER_TESTBEDS, make_cost_model

CALIBRATION = pathlib.Path(__file__).resolve().parents[2] / "shared" / "calibration"
needs_calibration = pytest.mark.skipif(not CALIBRATION.is_dir(), reason="../shared/calibration is not beside the checkout")
OPT13B, A100 = get_config("opt-13b"), get_hardware("a100-80g")


@pytest.fixture(scope="module")
def runs():
    return {run.rate: run for run in read_distserve_runs(CALIBRATION / "distserve-vllm-opt13b-a100-80g")}


@needs_calibration
def test_shipped_fit_is_the_fit_of_the_published_measurements(runs) -> None:
    shipped = published_fit()
    kernels, _ = fit_kernels(CALIBRATION / "vidur-a100")
    numbers = [f.name for f in dataclasses.fields(kernels) if f.name != "fit_range"]
    assert [getattr(kernels, n) for n in numbers] == pytest.approx([getattr(shipped.kernels, n) for n in numbers],
                                                                  rel=1e-6)
    assert kernels.fit_range == shipped.kernels.fit_range
    ours = shipped.engines["vllm-0.2.3-server"]
    online, _ = fit_engine_to_runs(kernels, [runs[1.0], runs[3.0]], dataclasses.replace(ours, step=0.0, per_seq=0.0))
    vidur = fit_cpu_overhead(read_profile_csv(CALIBRATION / "vidur-a100" / "cpu_overheads.csv"))
    assert (online.gpu_slowdown, online.step, online.per_seq) == pytest.approx(
        (ours.gpu_slowdown, ours.step, ours.per_seq), rel=1e-6)
    assert (vidur.params["step"], vidur.params["per_seq"]) == pytest.approx(
        (shipped.engines["vllm-0.4-offline"].step, shipped.engines["vllm-0.4-offline"].per_seq), rel=1e-6)
    # the sources are named beside the numbers; what no measurement fixes says so
    text = json.loads(PUBLISHED.read_text())
    assert "Vidur" in text["sources"]["kernels"] and "DistServe" in ours.source
    for engine in shipped.engines.values():
        assert engine.source and (engine.estimate == ("estimate" in engine.source or "planning" in engine.source))
    assert {"vllm-0.2.3-server", "vllm-0.2.3-offline", "vllm-0.4-offline", "vllm-0.5-eager",
            "jserve"} <= set(shipped.engines)


def test_measured_terms_grow_as_kernels_do() -> None:
    model = make_cost_model("measured", OPT13B, A100)
    assert isinstance(model, MeasuredCostModel) and not model.estimated_on
    decode = [model.step_time(StepShape.decode([500] * b)) for b in (1, 8, 64, 256)]
    assert decode == sorted(decode) and decode[0] > 0.015  # a decode reads 26 GB of weights
    assert model.step_time(StepShape.decode([2000] * 32)) > model.step_time(StepShape.decode([200] * 32))
    prefill = [model.step_time(StepShape.prefill(n)) for n in (64, 512, 2048)]
    assert prefill == sorted(prefill)
    # prefill is compute-bound: 2,048 tokens cost far more than one decode of the weights
    assert prefill[-1] > 10 * decode[0]
    # a chunk after a cached prefix costs less than the whole prompt again
    assert model.step_time(StepShape.prefill(256, start=1792)) < prefill[-1]
    shape = StepShape.decode([700] * 40)
    assert sum(model.breakdown(shape).values()) == pytest.approx(model.step_time(shape))
    tp2 = make_cost_model("measured", OPT13B, A100, tensor_parallel=2)
    assert tp2.kernel_time(shape) < model.kernel_time(shape)
    assert make_cost_model("measured", OPT13B, get_hardware("l20")).estimated_on


def test_every_named_cost_model_builds_an_engine() -> None:
    for name in COST_MODELS:
        bed = PAPER_TESTBEDS.get(name)
        hw = bed.hardware if bed else "a100-80g"
        model = "opt-13b" if hw != "l20" else "llama-2-7b"
        built = EngineConfig(runner="sim", model=model, hardware=hw, cost_model=name)
        assert built.sim_kv_blocks() > 0


def test_a_paper_testbed_keeps_to_its_hardware() -> None:
    with pytest.raises(ValueError, match="pass --hardware a100-40g"):
        EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g", cost_model="apt-serve")
    with pytest.raises(ValueError, match="unknown cost model|must be one of"):
        EngineConfig(runner="sim", model="opt-13b", cost_model="nosuch")


def test_kv_capacity_follows_vllms_profiling_pass() -> None:
    """vLLM sizes its cache after a profiling pass of max_num_batched_tokens: the real runs'
    server (16,384 tokens, 1,024 sequences) holds fewer blocks than vLLM's defaults."""
    served = distserve_engine().sim_kv_blocks()
    default = dataclasses.replace(distserve_engine(), max_num_batched_tokens=None, max_num_seqs=256)
    assert 3300 <= served <= 3450 < default.sim_kv_blocks()


@needs_calibration
@pytest.mark.parametrize("rate", [1.0, 4.0])  # fitted on 1 (and 3) req/s; 4 is held out
def test_replayed_real_runs_stay_within_the_goal(runs, rate: float) -> None:
    run = runs[rate]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/run.jsonl"
        save_trace(run.trace, path)
        result = run_benchmark(BenchConfig(engine=distserve_engine(), trace=path), progress=False)
    by_id = {r.request_id: r for r in result.records}
    done = [by_id[r.request_id] for r in run.trace.requests]
    sim_tpot = np.array([tpot(r) or np.nan for r in done])
    sim_ttft = np.array([ttft(r) for r in done])
    for real, sim in ((run.tpot, sim_tpot), (run.ttft, sim_ttft)):
        for p in (50, 90):
            assert np.nanpercentile(sim, p) / np.nanpercentile(real, p) == pytest.approx(1.0, abs=0.15)
