"""Rate sweeps: SLO attainment and tail latency versus arrival rate, per policy.

A sweep's points (policies x rates x seeds) are independent benchmarks, so they run in
parallel: in local processes by default, or as tasks on a Ray cluster (`ray_address`). Each
point is deterministic (the simulator's clock is virtual), so the results are those of the
sequential run, returned in the same order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jserve.benchmarking.bench import (
    BenchConfig,
    BenchResult,
    config_json,
    run_benchmark,
    simulated_json,
)
from jserve.benchmarking.metrics import effective_throughput

# (summary field, axis label); latencies plotted in ms.
PLOTTED = [
    ("slo_attainment", "joint SLO attainment"),
    ("ttft_p99", "P99 TTFT (ms)"),
    ("tbt_p99", "P99 TBT (ms)"),
    ("norm_latency_mean", "mean normalized latency (ms/token)"),
]


@dataclass
class SweepResult:
    base: BenchConfig
    rates: list[float]
    results: dict[str, list[BenchResult]]  # policy -> one result per rate

    def effective_throughput(self, policy: str) -> float | None:
        att = [r.summary.slo_attainment for r in self.results[policy]]
        return effective_throughput(self.rates, att)

    def to_json(self) -> dict[str, Any]:
        config = config_json(self.base)  # less what the sweep varies
        del config["rate"], config["engine"]["policy"]
        return {
            "config": config,
            "simulated": simulated_json(self.base),
            "rates": self.rates,
            "effective_throughput": {p: self.effective_throughput(p) for p in self.results},
            "summaries": {p: [r.summary.to_dict() for r in rs] for p, rs in self.results.items()},
        }


def run_sweep(base: BenchConfig, policies: list[str], rates: list[float], progress: bool = True,
              workers: int | None = 1, ray_address: str | None = None) -> SweepResult:
    """Every policy at every rate, at `base.seed` (see `run_sweeps` for `workers` and
    `ray_address`; one worker, the default here, runs the points in this process)."""
    return run_sweeps(base, policies, rates, [base.seed], progress, workers, ray_address)[0]


def run_sweeps(base: BenchConfig, policies: list[str], rates: list[float], seeds: Sequence[int],
               progress: bool = True, workers: int | None = None, ray_address: str | None = None
               ) -> list[SweepResult]:
    """One sweep per seed, all their points run together by `run_points`."""
    points = [dataclasses.replace(base.with_policy(p, r), seed=seed)
              for seed in seeds for p in policies for r in rates]
    results = iter(run_points(points, progress, workers, ray_address))
    return [SweepResult(dataclasses.replace(base, seed=seed), rates,
                        {p: [next(results) for _ in rates] for p in policies})
            for seed in seeds]


def run_points(configs: Sequence[BenchConfig], progress: bool = True, workers: int | None = None,
               ray_address: str | None = None) -> list[BenchResult]:
    """Each benchmark's result, in `configs`' order: as Ray tasks on the cluster at
    `ray_address` ('auto', 'host:port', 'ray://host:port', or 'local' for a new cluster on
    this machine; a Ray already initialised in this process is used as it is), else in
    `workers` local processes (None: one per CPU), or in this process for one worker.
    `progress` shows one bar over the points, or over one point's requests when it is alone."""
    if ray_address is not None:
        return _run_on_ray(configs, ray_address, progress)
    if len(configs) == 1:
        return [run_benchmark(configs[0], progress)]
    workers = min(len(configs), workers or os.cpu_count() or 1)
    if workers <= 1:
        return list(_progress(map(run_point, configs), len(configs), progress))
    # spawn, not fork: the parent has JAX's threads running, which a forked child would lack
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(_progress(pool.map(run_point, configs), len(configs), progress))


def run_point(config: BenchConfig) -> BenchResult:
    """One sweep point, run where a worker runs it (without a progress bar of its own)."""
    return run_benchmark(config, progress=False)


def _run_on_ray(configs: Sequence[BenchConfig], address: str, progress: bool) -> list[BenchResult]:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    task = ray.remote(num_cpus=1)(run_point)
    refs = [task.remote(c) for c in configs]
    return list(_progress((ray.get(r) for r in refs), len(refs), progress))


def _progress(results, total: int, progress: bool):
    if not progress:
        return results
    from tqdm import tqdm

    return tqdm(results, total=total, desc="sweep points", unit="point")


def plot_sweep(sweep: SweepResult, path: str | pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (field, label) in zip(axes.flat, PLOTTED):
        scale = 1.0 if field == "slo_attainment" else 1e3
        for policy, results in sweep.results.items():
            ys = [getattr(r.summary, field) for r in results]
            ax.plot(sweep.rates, [math.nan if y is None else y * scale for y in ys], "o-", label=policy)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(label)
        if field != "slo_attainment":
            ax.set_yscale("log")
        else:
            ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    b, e = sweep.base, sweep.base.engine
    fig.suptitle(f"{e.model_name} on {e.hardware if e.runner == 'sim' else 'this machine'} "
                 f"({e.runner}), {b.workload}, {b.num_requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(sweep: SweepResult, output: str | pathlib.Path) -> pathlib.Path:
    """Write the JSON and a PNG beside it; returns the PNG's path."""
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(sweep.to_json(), indent=1))
    png = output.with_suffix(".png")
    plot_sweep(sweep, png)
    return png
