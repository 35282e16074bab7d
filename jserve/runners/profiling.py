"""Measure real step times over a grid of batch shapes and fit the simulator's cost model.

`jserve profile` runs this on the machine to be simulated (`jserve.benchmarking.calibrate`
builds the engine); `jserve bench --engine sim --profile FILE` then charges every simulated
step from the fitted model. The grid spans
what the features need to be told apart: prefills of one and of several prompts, chunks
that start after a cached prefix, decodes at several batch sizes and context lengths.

`measure_preemption` times the two ways of preempting a request on the real runner, for
CacheOpt's swap-vs-recompute sweet spot (`jserve.runners.preemption_cost`), and
`measure_hidden_projection` the K/V recompute a hidden-cache request adds to a step, fitted per
block: Apt-Serve's rho (Eq. 6), stored in the profile file beside the cost model.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jserve.cache_features.hidden_cache.batch import HiddenBatch
from jserve.cache_features.hidden_cache.section import NAME
from jserve.engine.batch import Batch, BatchDelta, BatchInputs, BlockMove
from jserve.runners.cost_model import CalibratedCostModel, StepShape
from jserve.runners.jax_runner import JaxRunner
from jserve.runners.preemption_cost import PreemptionProfile
from jserve.models.config import ModelConfig


def profile_shapes(max_len: int) -> list[tuple[list[int], list[int]]]:
    """(starts, query_lens) per sequence for each profiled step, within `max_len`."""
    shapes: list[tuple[list[int], list[int]]] = []
    for n in (16, 64, 256, 512, 1024):
        shapes.append(([0], [n]))
    for seqs, n in ((4, 64), (4, 256), (8, 128)):
        shapes.append(([0] * seqs, [n] * seqs))
    for prefix, n in ((256, 128), (512, 256)):
        shapes.append(([prefix], [n]))
        shapes.append(([prefix] + [256] * 16, [n] + [1] * 16))
    for batch in (1, 4, 16, 32, 64):
        for ctx in (64, 256, 512, 1024):
            shapes.append(([ctx] * batch, [1] * batch))
    return [(s, q) for s, q in shapes if max(a + b for a, b in zip(s, q)) <= max_len]


def _batch(starts: list[int], query_lens: list[int], block_size: int, hidden_block_tokens: int = 0) -> Batch:
    """A batch over disjoint, contiguous block ranges (values do not matter for timing);
    with `hidden_block_tokens`, every sequence on Apt-Serve's hidden cache."""
    n = len(starts)
    start = np.asarray(starts, np.int32)
    q = np.asarray(query_lens, np.int32)
    per_block = hidden_block_tokens or block_size
    sizes = [-(-(s + k) // per_block) for s, k in zip(starts, query_lens)]
    offsets = np.cumsum([0, *sizes])
    tables = tuple(np.arange(offsets[i], offsets[i + 1], dtype=np.int32) for i in range(n))
    z = np.zeros
    inputs = BatchInputs(z(int(q.sum()), np.int32), z(n, np.int32), BatchDelta.of_sequences(range(n), tables))
    hidden = {NAME: HiddenBatch(np.ones(n, bool))} if hidden_block_tokens else {}
    return Batch(np.arange(n), start, q, np.ones(n, bool), inputs, features=hidden)


def measure(runner: JaxRunner, shapes: list[tuple[list[int], list[int]]], repeats: int = 3
            ) -> Iterator[tuple[StepShape, float]]:
    """Median wall time of each shape after one untimed (compiling) run."""
    for starts, query_lens in shapes:
        batch = _batch(starts, query_lens, runner.block_size)
        runner.execute(batch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute(batch)
            times.append(time.perf_counter() - t0)
        yield StepShape.of(batch, runner.buckets.tokens), float(np.median(times))


def profile_num_blocks(shapes: list[tuple[list[int], list[int]]], block_size: int) -> int:
    """KV blocks the largest profiled step holds (`_batch` gives each sequence its own)."""
    return max(sum(-(-(s + q) // block_size) for s, q in zip(st, ql)) for st, ql in shapes)


def fit_profile(runner: JaxRunner, shapes: list[tuple[list[int], list[int]]], model_name: str,
                repeats: int = 3, progress: bool = True) -> CalibratedCostModel:
    """Time `shapes` on `runner` and fit the simulator's cost model to them."""
    import jax

    it = measure(runner, shapes, repeats)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=len(shapes), desc="profiling step shapes", unit="shape")
    samples = list(it)
    device = f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}"
    return CalibratedCostModel.fit(samples, model_name=model_name, device=device)


def _timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` (which waits for its results) after `warmup` untimed runs:
    the first compiles, and the second meets the cache as the swap jits return it (a
    different layout from the step's, compiled once more)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_preemption(runner: JaxRunner, sizes: list[int], repeats: int = 3) -> PreemptionProfile:
    """Real latencies of preempting a request of each length, through the engine's own paths:
    recompute = a prefill step of S tokens (`execute`, outputs fetched); swap = S tokens'
    blocks swapped out and back in by the runner's host store (`execute` of a batch that only
    moves them, the device cache ready afterwards), as the paper's Figure 8 counts both."""
    import jax

    empty = np.zeros(0, np.int64)
    recompute, swap = [], []
    for n in sizes:
        prefill = _batch([0], [n], runner.block_size)
        recompute.append(_timed(lambda b=prefill: runner.execute(b), repeats))
        blocks = prefill.inputs.delta.tables[0][1]
        moves = (BlockMove(0, blocks),)
        out = Batch(empty, empty.astype(np.int32), empty.astype(np.int32), empty.astype(bool), swap_out=moves)
        back = Batch(empty, empty.astype(np.int32), empty.astype(np.int32), empty.astype(bool), swap_in=moves)

        def out_and_in(out: Batch = out, back: Batch = back) -> None:
            runner.execute(out)
            runner.execute(back)
            jax.block_until_ready(runner.cache)

        swap.append(_timed(out_and_in, repeats))
    return PreemptionProfile(tuple(sizes), tuple(recompute), tuple(swap))


HIDDEN_LENGTHS = (64, 256, 1024, 4096)  # hidden rows per timed projection
HIDDEN_CACHE_KEY = "hidden_cache"  # the profile file's entry for Apt-Serve's rho


@dataclass(frozen=True)
class HiddenProjectionProfile:
    """Time of recomputing K and V from `n` hidden rows in every layer (`rows[i]` rows took
    `seconds[i]`), what a hidden-cache request adds to each step it runs in (Apt-Serve's
    Eq. 6). `per_row` is the fitted slope: the fixed cost of a projection is paid once per
    step whatever the number of hidden requests, so rho is the slope times the rows a block
    holds. The slope is the median of the pairwise slopes (Theil-Sen), so one sample a
    noisy host slowed (7.8 ms beside 0.1-0.7 ms, seen on CI) cannot flatten it to 0. `divisor`: the authors' code divides its fitted rho by 5 (unexplained); 1 here
    unless asked for (`jserve profile --hidden-cost-divisor 5`)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    divisor: float = 1.0

    @property
    def per_row(self) -> float:
        rows, seconds = np.asarray(self.rows, float), np.asarray(self.seconds)
        i, j = np.triu_indices(len(rows), 1)
        apart = rows[j] != rows[i]
        slopes = (seconds[j] - seconds[i])[apart] / (rows[j] - rows[i])[apart]
        return max(float(np.median(slopes)), 0.0) if slopes.size else 0.0

    def block_cost(self, hidden_block_tokens: int) -> float:
        """rho: seconds per block of `hidden_block_tokens` hidden rows in a batch."""
        return self.per_row * hidden_block_tokens / self.divisor

    def to_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "seconds": list(self.seconds), "divisor": self.divisor,
                "seconds_per_row": self.per_row}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiddenProjectionProfile:
        return cls(tuple(int(n) for n in d["rows"]), tuple(float(t) for t in d["seconds"]),
                   float(d.get("divisor", 1.0)))


def measure_hidden_projection(cfg: ModelConfig, dtype: Any, rows: Sequence[int] = HIDDEN_LENGTHS,
                              repeats: int = 3, divisor: float = 1.0) -> HiddenProjectionProfile:
    """Time the K/V projection (with bias) of `n` hidden rows on this device in `dtype`, one
    layer's weights timed and counted `num_layers` times (a whole model's stack of them need
    not fit beside the profiled engine)."""
    import jax
    import jax.numpy as jnp

    kv_dim = cfg.num_kv_heads * cfg.head_dim
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (cfg.hidden_size, 2 * kv_dim), dtype)
    b = jnp.zeros((2 * kv_dim,), dtype)
    project = jax.jit(lambda x: x @ w + b)
    seconds = []
    for n in rows:
        x = jax.random.normal(key, (int(n), cfg.hidden_size), dtype)
        seconds.append(cfg.num_layers * _timed(lambda x=x: jax.block_until_ready(project(x)), repeats))
    return HiddenProjectionProfile(tuple(int(n) for n in rows), tuple(seconds), divisor)


def save_hidden_profile(path: str | os.PathLike[str], profile: HiddenProjectionProfile) -> None:
    """Add the hidden-cache entry to a saved profile file (the cost-model fit ignores it)."""
    p = pathlib.Path(path)
    d = json.loads(p.read_text())
    d[HIDDEN_CACHE_KEY] = profile.to_dict()
    p.write_text(json.dumps(d, indent=1))


def load_hidden_profile(path: str | os.PathLike[str]) -> HiddenProjectionProfile | None:
    """The hidden-cache entry of a profile file; None for a profile measured without one."""
    d = json.loads(pathlib.Path(path).read_text()).get(HIDDEN_CACHE_KEY)
    return None if d is None else HiddenProjectionProfile.from_dict(d)
