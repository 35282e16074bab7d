"""Published real serving runs, read as jserve traces with their measured latencies, so the
simulator can replay them request by request (`bench/sim_vs_real.py`) and fits can read
their lengths (`bench/calibrate_sim.py`).

The format read is DistServe's per-request results (`vllm-N-R.exp`: N requests at R req/s;
LLMServe/DistServe, Apache-2.0; see `../shared/calibration/README.md`): the first line is a
Python-literal list of one dict per request with `prompt_len`, `output_len`, and
`issue_time`, `first_token_time`, `complete_time` on one clock (seconds); summary lines
follow, which are not read.
"""

from __future__ import annotations

import ast
import math
import pathlib
import re
from dataclasses import dataclass

import numpy as np

from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.config import EngineConfig

RUN_NAME = re.compile(r"vllm-(\d+)-([\d.]+)\.exp")


def distserve_engine(**overrides: object) -> EngineConfig:
    """The simulated engine of DistServe's real vLLM runs: OPT-13B on one A100-80GB, vLLM
    0.2.3's scheduler, and the server's options (its
    evaluation/2-benchmark-serving/2-start-api-server.py: block 16, 16 GiB swap,
    gpu_memory_utilization 0.95, 16,384 batched tokens, 1,024 sequences)."""
    settings: dict[str, object] = dict(
        model="opt-13b", runner="sim", hardware="a100-80g", policy="vllm-0.2.3", block_size=16,
        swap_space=16, gpu_memory_utilization=0.95, max_model_len=2048, max_num_batched_tokens=16384,
        max_num_seqs=1024)
    return EngineConfig(**(settings | overrides))


@dataclass(frozen=True)
class PublishedRun:
    """One real run: its requests as a replayable trace (ids `r0`, `r1`, ... in arrival
    order) and each request's measured TTFT and TPOT in seconds, in the same order (TPOT is
    NaN for a one-token output)."""

    name: str
    rate: float
    trace: Trace
    ttft: np.ndarray
    tpot: np.ndarray


def read_distserve_run(path: str | pathlib.Path) -> PublishedRun:
    path = pathlib.Path(path)
    match = RUN_NAME.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path}: not a DistServe run file (expected vllm-N-R.exp)")
    try:
        rows = ast.literal_eval(path.read_text().splitlines()[0])
    except (ValueError, SyntaxError, IndexError) as e:
        raise ValueError(f"{path}: first line is not a Python-literal list of requests ({e})") from None
    rows = sorted(rows, key=lambda r: r["issue_time"])
    start = rows[0]["issue_time"]
    rate = float(match.group(2))
    requests = tuple(TraceRequest(f"r{i}", r["issue_time"] - start, r["prompt_len"], r["output_len"])
                     for i, r in enumerate(rows))
    ttft = np.array([r["first_token_time"] - r["issue_time"] for r in rows])
    tpot = np.array([(r["complete_time"] - r["first_token_time"]) / (r["output_len"] - 1)
                     if r["output_len"] > 1 else math.nan for r in rows])
    return PublishedRun(path.stem, rate, Trace("distserve-sharegpt", requests, 0, rate, 1.0), ttft, tpot)


def read_distserve_runs(folder: str | pathlib.Path) -> list[PublishedRun]:
    """Every run in `folder`, by rate."""
    folder = pathlib.Path(folder)
    paths = sorted(folder.glob("vllm-*.exp"))
    if not paths:
        raise FileNotFoundError(f"no DistServe runs (vllm-N-R.exp) in {folder}")
    return sorted((read_distserve_run(p) for p in paths), key=lambda r: r.rate)
