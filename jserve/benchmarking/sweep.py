"""Rate sweeps: SLO attainment and tail latency versus arrival rate, per policy."""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from jserve.benchmarking.bench import (
    BenchConfig,
    BenchResult,
    config_json,
    run_benchmark,
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
            "rates": self.rates,
            "effective_throughput": {p: self.effective_throughput(p) for p in self.results},
            "summaries": {p: [r.summary.to_dict() for r in rs] for p, rs in self.results.items()},
        }


def run_sweep(base: BenchConfig, policies: list[str], rates: list[float], progress: bool = True
              ) -> SweepResult:
    results = {
        p: [run_benchmark(base.with_policy(p, r), progress) for r in rates]
        for p in policies
    }
    return SweepResult(base, rates, results)


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
