"""`jserve profile`: time the real runner over a grid of step shapes and fit the simulator's
cost model to it (`jserve.runners.profiling` measures; this builds the engine to measure).

The profile then calibrates `jserve bench --engine sim --profile FILE`, and on either runner
prices CacheOpt's swap-vs-recompute choice.
"""

from __future__ import annotations

from typing import cast

from jserve.builder import build_engine
from jserve.config import EngineConfig
from jserve.runners.cost_model import CalibratedCostModel
from jserve.runners.jax_runner import JaxRunner
from jserve.runners.profiling import (
    fit_profile,
    measure_hidden_projection,
    profile_num_blocks,
    profile_shapes,
    save_hidden_profile,
)

BLOCK_SIZE = 16
MIN_BLOCKS = 64


def run_profile(model: str, output: str, max_len: int = 2048, repeats: int = 3,
                progress: bool = True, hidden_cost_divisor: float = 1.0) -> CalibratedCostModel:
    """Profile `model` on this machine's device at contexts up to `max_len`, save the fitted
    cost model to `output` with the hidden-cache projection times (Apt-Serve's rho, divided
    by `hidden_cost_divisor`: the authors' code uses 5) and return it."""
    shapes = profile_shapes(max_len)
    config = EngineConfig(model=model, block_size=BLOCK_SIZE, max_model_len=max_len, warmup=False,
                          num_blocks=max(profile_num_blocks(shapes, BLOCK_SIZE), MIN_BLOCKS))
    built = build_engine(config)
    runner = cast(JaxRunner, built.runner)  # a real config builds the JAX runner
    fitted = fit_profile(runner, shapes, model, repeats, progress)
    fitted.save(output)
    dtype = built.loaded.model.embed.embedding.get_value().dtype  # the weights' (a real engine's)
    save_hidden_profile(output, measure_hidden_projection(built.model_config, dtype, repeats=repeats,
                                                          divisor=hidden_cost_divisor))
    return fitted
