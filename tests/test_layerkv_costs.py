"""LayerKV's Eqs. 3-4 (`jserve.engine.layerkv_costs`) and their fitted factors
(`jserve.runners.layerkv_cost`)."""

from __future__ import annotations

import numpy as np
import pytest

from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.runners.cost_model import RooflineCostModel, StepShape
from jserve.runners.hardware import get_hardware
from jserve.runners.layerkv_cost import (
    fit_lengths,
    layerkv_costs_from_cost_model,
    relative_factor,
)
from jserve.models.registry import get_config

# Round figures, so each equation can be checked by hand.
COSTS = LayerKVCosts(num_params=1e9, hidden_size=1000, kv_dim=500, dtype_bytes=2, flops=1e12,
                     pcie_bandwidth=1e9, alpha=2.0, beta=1.5)


def test_eq3_prefill_time():
    # 2 * 100 * (2e9 + 2 * 100 * 1000) / 1e12 = 0.40004 s
    assert COSTS.prefill_time(100) == pytest.approx(2 * 100 * (2e9 + 2e5) / 1e12)
    np.testing.assert_allclose(COSTS.prefill_time(np.array([100, 200])),
                               [COSTS.prefill_time(100), COSTS.prefill_time(200)])


def test_eq4_offload_time_counts_kv_heads():
    # 1.5 * 100 tokens * 2 (K, V) * 3 layers * 500 * 2 B / 1e9 B/s
    assert COSTS.offload_time(100, 3) == pytest.approx(1.5 * 100 * 2 * 3 * 500 * 2 / 1e9)
    assert COSTS.offload_time(100, 0) == 0.0


def test_kept_layers_are_the_fewest_whose_offload_hides_under_the_prefill():
    # one layer of 100 tokens: 3e-4 s; the prefill 0.40004 s hides 1333 of them
    assert COSTS.min_kept_layers(100, 32) == 0
    slow = LayerKVCosts(num_params=1e9, hidden_size=1000, kv_dim=500, dtype_bytes=2, flops=1e12,
                        pcie_bandwidth=1e6)  # 1,000x slower link: 0.2 s per layer vs 0.2 s prefill
    per_layer = slow.offload_time(100, 1)
    hidden = int(slow.prefill_time(100) // per_layer)
    x = slow.min_kept_layers(100, 32)
    assert x == 32 - hidden
    assert slow.offload_time(100, 32 - x) <= slow.prefill_time(100) < slow.offload_time(100, 32 - x + 1)
    np.testing.assert_array_equal(slow.min_kept_layers(np.array([100, 10**8]), 32), [x, 0])
    very_slow = LayerKVCosts(1e9, 1000, 500, 2, 1e12, pcie_bandwidth=1.0)
    assert very_slow.min_kept_layers(100, 32) == 32
    with pytest.raises(ValueError, match="alpha"):
        LayerKVCosts(1e9, 1000, 500, 2, 1e12, 1e9, alpha=0.0)


def test_relative_factor_recovers_a_scale_exactly():
    f = np.array([1.0, 2.0, 5.0])
    assert relative_factor(f, 1.7 * f) == pytest.approx(1.7)


def test_fitted_factors_for_llama2_7b_on_l20():
    cfg, hw = get_config("llama-2-7b"), get_hardware("l20")
    costs = layerkv_costs_from_cost_model(RooflineCostModel(cfg, hw), cfg, hw, 2, fit_lengths(16384))
    assert fit_lengths(16384)[0] == 64 and fit_lengths(16384)[-1] == 16384 and fit_lengths(1000)[-1] == 1000
    # the roofline's 0.6 MFU and its fixed step cost: alpha a little above 1 / 0.6
    assert 1 / hw.mfu < costs.alpha < 2.0
    # the roofline moves layers at the datasheet's link rate: Eq. 4 exactly
    assert costs.beta == pytest.approx(1.0)
    assert costs.kv_dim == 4096  # 32 KV heads of 128
    # the first reading: every layer can be offloaded at every prompt length
    assert costs.min_kept_layers(np.array([16, 128, 1024, 16384]), 32).tolist() == [0, 0, 0, 0]


def test_gqa_models_offload_kv_heads_only():
    cfg, hw = get_config("llama-3.1-70b"), get_hardware("l20")
    costs = layerkv_costs_from_cost_model(RooflineCostModel(cfg, hw), cfg, hw, 2, fit_lengths(4096))
    assert costs.kv_dim == cfg.num_kv_heads * cfg.head_dim == 1024


def test_decode_line_fits_the_cost_models_decode_steps():
    cfg, hw = get_config("llama-2-7b"), get_hardware("l20")
    model = RooflineCostModel(cfg, hw)
    costs = layerkv_costs_from_cost_model(model, cfg, hw, 2, fit_lengths(4096))
    for n, c in ((1, 100), (32, 1000), (200, 600)):
        assert costs.decode_time(n, n * c) == pytest.approx(model.step_time(StepShape.decode([c] * n)), rel=0.1)
    assert costs.decode_time(0, 0) == 0.0
