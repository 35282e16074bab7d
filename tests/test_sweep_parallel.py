"""`jserve sweep` runs its points in parallel (local processes, or Ray tasks with --ray) and
gets exactly the sequential run's results, in the same order."""

from __future__ import annotations

import json

import pytest

from jserve.benchmarking.bench import BenchConfig
from jserve.benchmarking.sweep import run_points, run_sweeps
from jserve.cli import main
from jserve.config import EngineConfig

SWEEP = ["sweep", "--engine", "sim", "--model", "opt-13b", "--policies", "vllm,sarathi",
         "--rates", "5,50", "--workload", "fixed:64:16", "--num-requests", "20",
         "--ttft-slo", "0.5", "--tbt-slo", "0.1"]


def _points() -> list[BenchConfig]:
    base = BenchConfig(EngineConfig(runner="sim", model="opt-13b"), workload="fixed:64:16",
                       num_requests=20, ttft_slo=0.5, tbt_slo=0.1)
    return [base.with_policy(p, r) for p in ("vllm", "sarathi") for r in (5.0, 50.0)]


def test_local_processes_give_the_sequential_results_in_order():
    points = _points()
    sequential = run_points(points, progress=False, workers=1)
    parallel = run_points(points, progress=False, workers=2)
    assert [r.config for r in parallel] == points
    assert [(r.summary, r.records) for r in parallel] == [(r.summary, r.records) for r in sequential]


def test_seeds_are_sweep_points_too():
    base = _points()[0]
    a, b = run_sweeps(base, ["vllm"], [5.0, 50.0], seeds=[0, 1], progress=False, workers=1)
    assert (a.base.seed, b.base.seed) == (0, 1)
    assert a.results["vllm"][0].config.seed == 0 and b.results["vllm"][1].config.seed == 1
    assert a.results["vllm"][0].summary != b.results["vllm"][0].summary


# Ray starts its raylet with subprocess (fork + exec at once), which JAX's fork warning flags.
# Slow (17 s, most of it the cluster's start): bench/nightly.sh runs it; CI runs the same
# sweep over local processes (`test_local_processes_give_the_sequential_results_in_order`).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_two_worker_ray_cluster_runs_the_sweep_like_the_sequential_run(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'jserve[test]')")
    assert main([*SWEEP, "--workers", "1", "--output", str(tmp_path / "seq.json")]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.cluster_resources()["CPU"] == 2
        assert main([*SWEEP, "--ray", "local", "--output", str(tmp_path / "ray.json")]) == 0
    finally:
        ray.shutdown()
    seq, on_ray = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("seq", "ray"))
    assert on_ray == seq and seq["summaries"]["vllm"][0]["num_finished"] == 20
