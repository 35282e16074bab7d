"""Timing helpers shared by the device benchmarks (kernels.py, decode_step.py, sampling.py,
sampling_cutoffs.py).

Device work is asynchronous, so every timed call blocks until its outputs are ready;
calls are warmed up first (compilation stays out of the numbers) and the median of many
runs is reported. The bandwidth ceiling is measured, not taken from a datasheet: a large
device-to-device elementwise copy, counting bytes read plus bytes written.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable

import functools

import jax
import jax.numpy as jnp


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}"


def results_tag() -> str:
    """The suffix of a benchmark's results file: `cpu` on CPU, else the device kind as JAX
    reports it with spaces as dashes (e.g. `NVIDIA-H100-80GB-HBM3`)."""
    if jax.default_backend() == "cpu":
        return "cpu"
    kind = getattr(jax.devices()[0], "device_kind", jax.default_backend())
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in kind)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def today() -> str:
    return datetime.date.today().isoformat()


def median_seconds(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 20) -> float:
    """Median wall time of `fn()` with its outputs ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def turn_about_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each `fn()` with its outputs ready, the functions taking turns
    repeat after repeat, so that a change in the machine's load hits them alike; each is
    called once untimed first (compiling)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(nbytes: int, repeats: int = 20) -> float:
    """Bytes/s of a jit elementwise copy of a random `nbytes` float32 buffer (read + write).

    `x * 2` rather than a plain copy, which XLA may elide or alias away.
    """
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    double = jax.jit(lambda a: a * 2)
    return 2 * x.nbytes / median_seconds(lambda: double(x), repeats=repeats)


def random_like(shape: tuple[int, ...], dtype, seed: int = 0) -> jax.Array:
    """Random normal data made on the device (never time on zeros: they hide unwritten
    outputs and can run faster than real data)."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0)
def random_cache(cache):
    """`cache` (a `KVCache`) filled with random data in place (donated: one cache in memory)."""
    return type(cache)(random_like(cache.k.shape, cache.k.dtype, 0), random_like(cache.v.shape, cache.v.dtype, 1))
