"""Fitting LayerKV's empirical factors (alpha of Eq. 3, beta of Eq. 4;
`jserve.engine.layerkv_costs`) to the runner's cost model or profile.

The paper derives alpha "from profiling data" and gives no value for either factor. We
profile the cost model in use (the roofline, or a `CalibratedCostModel` fitted to `jserve
profile`): alpha from lone prefills of `lengths` tokens against Eq. 3 at alpha = 1, beta
from the time to write those tokens' K/V of every layer to host against Eq. 4 at beta = 1.
Each is one factor through the origin fitted in relative error (`sum (k * f / t - 1)^2`
minimised: k = sum(f / t) / sum((f / t)^2)), so short prompts, which set the admissions of a
busy step, count as much as long ones. The decode-iteration line that stands for Eq. 1's
"current TPOT" is fitted (non-negative least squares) to decode steps of `DECODE_SEQS`
sequences at `DECODE_CONTEXTS` tokens of context each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.cache_features.layer_offload.batch import LayerTraffic
from jserve.runners.cost_model import CostModel, StepShape, nnls
from jserve.runners.hardware import Hardware
from jserve.models.config import ModelConfig

# Prompt lengths profiled: 64 tokens up to the engine's longest prompt, doubling.
MIN_FIT_TOKENS = 64
DECODE_SEQS = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (128, 512, 2048)


def fit_lengths(max_model_len: int) -> tuple[int, ...]:
    """64, 128, ... up to `max_model_len` (which is included)."""
    n = MIN_FIT_TOKENS
    out = []
    while n < max_model_len:
        out.append(n)
        n *= 2
    return (*out, max_model_len)


def offload_step(layer_bytes: int, num_layers: int) -> StepShape:
    """A step that only writes `layer_bytes` of every layer to host, as a prefill does."""
    zeros = (0,) * num_layers
    out = LayerTraffic(prefill_to_host=(layer_bytes,) * num_layers, to_host=zeros,
                         to_device=zeros, device_copy=zeros)
    return StepShape(0, 0, 0, 0, 0, layer_bytes=out)


def relative_factor(formula: np.ndarray, measured: np.ndarray) -> float:
    """k minimising sum((k * formula / measured - 1)^2)."""
    r = np.asarray(formula, np.float64) / np.asarray(measured, np.float64)
    return float(r.sum() / (r * r).sum())


def layerkv_costs_from_cost_model(cost: CostModel, cfg: ModelConfig, hw: Hardware, dtype_bytes: int,
                                  lengths: Sequence[int]) -> LayerKVCosts:
    """Eq. 3 and 4's figures for `cfg` on `hw`, alpha and beta fitted to `cost`."""
    bare = LayerKVCosts(num_params=float(cfg.num_params), hidden_size=cfg.hidden_size,
                        kv_dim=cfg.num_kv_heads * cfg.head_dim, dtype_bytes=dtype_bytes,
                        flops=hw.peak_flops, pcie_bandwidth=hw.pcie_bandwidth)
    s = np.asarray(lengths, np.int64)
    prefill = np.array([cost.step_time(StepShape.prefill(int(n))) for n in s])
    per_token_layer = 2 * bare.kv_dim * dtype_bytes  # K and V of one token in one layer
    offload = np.array([cost.step_time(offload_step(int(n) * per_token_layer, cfg.num_layers)) for n in s])
    alpha = relative_factor(bare.prefill_time(s), prefill)
    beta = relative_factor(bare.offload_time(s, cfg.num_layers), offload)
    grid = [(n, c) for n in DECODE_SEQS for c in DECODE_CONTEXTS]
    x = np.array([[1.0, n, n * c] for n, c in grid])
    y = np.array([cost.step_time(StepShape.decode([c] * n)) for n, c in grid])
    base, per_seq, per_token = nnls(x, y)
    return dataclasses.replace(bare, alpha=alpha, beta=beta, decode_base=float(base),
                               decode_per_seq=float(per_seq), decode_per_token=float(per_token))
