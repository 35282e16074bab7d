"""The simulator's Python API (`jserve.sim`): docs/simulator.md's example runs as written, a
`SimConfig` is the config `jserve bench --engine sim` builds from the same options (same
figures), every option is documented, and a wrong option is refused before anything runs."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest

from jserve import LLM
from jserve.benchmarking.bench import BenchConfig
from jserve.cli import main
from jserve.config import EngineConfig
from jserve.sim import ENGINE_OPTIONS, SimConfig, simulate, sweep

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "simulator.md"


def doc_section() -> str:
    text = DOC.read_text()
    start = text.index("## From Python: `jserve.sim`")
    return text[start:text.index("\n## ", start + 1)]


def test_docs_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", doc_section(), re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    summary, curve = namespace["result"].summary, namespace["curve"]
    assert summary.num_finished == summary.num_requests == 100
    assert summary.slo_attainment is not None and summary.ttft_p99 >= summary.ttft_p50
    assert curve.rates == [2, 4, 8, 16] and list(curve.results) == ["vllm", "sarathi"]
    assert all(len(runs) == 4 for runs in curve.results.values())


def test_every_option_is_documented_with_its_default() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", doc_section(), re.M))
    defaults = SimConfig()
    for f in dataclasses.fields(SimConfig):
        assert f.name in rows, f.name
        assert rows[f.name].strip().strip('`"') == str(getattr(defaults, f.name)), f.name


def test_options_are_the_engine_and_benchmark_fields_with_their_defaults() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    bench = {f.name for f in dataclasses.fields(BenchConfig)}
    names = {f.name for f in dataclasses.fields(SimConfig)}
    assert ENGINE_OPTIONS <= names & engine
    assert names - ENGINE_OPTIONS <= bench
    assert SimConfig().bench_config() == BenchConfig()  # jserve bench's defaults


def test_simulate_gives_jserve_bench_s_figures(tmp_path: pathlib.Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "llama-2-7b", "--hardware", "h100", "--engine-overhead",
                 "vllm-0.4-offline", "--policy", "sarathi", "--workload", "sharegpt", "--rate", "6",
                 "--num-requests", "60", "--ttft-slo", "0.5", "--tbt-slo", "0.05", "--seed", "3",
                 "--output", str(out)]) == 0
    capsys.readouterr()
    cli = json.loads(out.read_text())
    result = simulate(SimConfig(model="llama-2-7b", hardware="h100", engine_overhead="vllm-0.4-offline",
                                policy="sarathi", workload="sharegpt", rate=6, num_requests=60,
                                ttft_slo=0.5, tbt_slo=0.05, seed=3))
    assert json.loads(json.dumps(result.summary.to_dict())) == cli["summary"]
    assert result.num_steps == cli["num_steps"] and result.num_blocks == cli["num_blocks"]
    assert json.loads(json.dumps(result.to_json()["simulated"])) == cli["simulated"]


def test_sweep_is_simulate_at_each_rate_and_policy() -> None:
    config = SimConfig(model="llama-2-7b", workload="fixed:64:32", num_requests=30, ttft_slo=0.2)
    curve = sweep(config, [8, 32], ["vllm", "fastgen"])
    for policy in ("vllm", "fastgen"):
        for rate, run in zip([8, 32], curve.results[policy]):
            alone = simulate(dataclasses.replace(config, policy=policy, rate=rate))
            assert run.summary == alone.summary
    assert list(sweep(config, [4], "fastgen").results) == ["fastgen"]


def test_unknown_options_name_themselves_and_what_was_meant() -> None:
    with pytest.raises(TypeError, match=r"unknown option 'hardwre' \(did you mean 'hardware'\?\)"):
        SimConfig(hardwre="h100")
    with pytest.raises(TypeError, match="'warmup' is an option of the real engine"):
        SimConfig(warmup=False)
    with pytest.raises(TypeError, match="SimConfig's options: model, hardware"):
        dataclasses.replace(SimConfig(), gpu="a100")
    with pytest.raises(TypeError):
        SimConfig("llama-2-7b")  # keyword-only


@pytest.mark.parametrize(("options", "reason"), [
    ({"rate": 0}, "rate must be > 0"),
    ({"policy": "nosuch"}, "unknown policy 'nosuch'"),
    ({"hardware": "tpu"}, "hardware must be one of"),
    ({"engine_overhead": "nosuch"}, "engine_overhead must be one of"),
    ({"workload": "nosuch"}, "nosuch"),
    ({"num_requests": 0}, "num_requests must be an int >= 1"),
    ({"model": "opt-175b"}, "does not fit"),
    ({"tbt_slo_on": "mean"}, "tbt_slo_on must be one of p99-tbt"),
    ({"predictions": "trained"}, "predictions must be one of noise"),
    ({"conversation_process": "poisson"}, "process must be one of"),
    ({"workload": "sharegpt-multiturn", "turn_rate": 0}, "turn_rate must be a finite number > 0"),
])
def test_bad_values_are_refused_when_the_config_is_made(options: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        SimConfig(**options)


def test_a_sweep_checks_its_points_before_running() -> None:
    config = SimConfig(num_requests=10)
    with pytest.raises(ValueError, match="at least one rate"):
        sweep(config, [])
    with pytest.raises(ValueError, match="rate must be > 0"):
        sweep(config, [1, -1])
    with pytest.raises(ValueError, match="unknown policy"):
        sweep(config, [1], ["vllm", "nosuch"])


def test_llm_refuses_the_simulator_and_points_to_it() -> None:
    with pytest.raises(ValueError, match="jserve.sim.simulate"):
        LLM(runner="sim")
