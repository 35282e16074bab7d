"""What the hidden cache costs in the simulator: a step's hidden sequences recompute K/V over
their past tokens (the cost model's `hidden_tokens`; the step's own tokens are projected as on
any cache), and rho (Apt-Serve's Eq. 6, the
view's `hidden_block_cost`) is that projection for one block of rows, from the cost model
the simulator runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hidden_cache_policy import ForcedHiddenCache, all_hidden

from jserve.builder import build_engine
from jserve.cache_features.hidden_cache.batch import HiddenBatch
from jserve.cache_features.hidden_cache.section import NAME, hidden_view
from jserve.config import EngineConfig
from jserve.engine.batch import Batch
from jserve.engine.sampling_params import SamplingParams
from jserve.runners.cost_model import CalibratedCostModel, RooflineCostModel, StepShape, hidden_block_cost
from jserve.runners.hardware import get_hardware
from jserve.runners.testbeds import make_cost_model
from jserve.models.registry import get_config

OPT13B, A100 = get_config("opt-13b"), get_hardware("a100-80g")


def _batch(hidden: np.ndarray | None) -> Batch:
    start, q = np.array([99, 0, 10]), np.array([1, 20, 1])
    return Batch(seq_ids=np.arange(3), start=start.astype(np.int32), query_lens=q.astype(np.int32),
                 sample=np.ones(3, bool), features={} if hidden is None else {NAME: HiddenBatch(hidden)})


def test_hidden_sequences_recompute_over_their_past_tokens() -> None:
    plain = StepShape.of(_batch(None))
    mixed = StepShape.of(_batch(np.array([True, False, True])))
    assert (plain.hidden_tokens, mixed.hidden_tokens) == (0, 99 + 10)
    model = RooflineCostModel(OPT13B, A100)
    assert model.step_time(mixed) > model.step_time(plain)
    assert model.hidden_recompute_time(mixed) == pytest.approx(
        4 * OPT13B.hidden_size ** 2 * OPT13B.num_layers * 109 / (A100.peak_flops * A100.mfu))
    # A hidden prefill has no past: its prompt's K/V are the forward pass's own.
    prefill = StepShape.of(_batch(np.array([False, True, False])))
    assert prefill.hidden_tokens == 0 and model.step_time(prefill) == model.step_time(plain)


def test_rho_is_one_block_of_projection() -> None:
    model = RooflineCostModel(OPT13B, A100)
    rho = hidden_block_cost(model, 32)
    assert rho == pytest.approx(4 * 5120 * 5120 * 40 * 32 / (A100.peak_flops * A100.mfu))
    calibrated = CalibratedCostModel((2e-3, 1e-5, 2e-5, 1e-5, 1e-9, 1e-9, 0.0, 0.0))
    assert hidden_block_cost(calibrated, 32) == 0.0  # no extras: unknown
    assert hidden_block_cost(calibrated.with_extras(model), 32) == rho
    assert hidden_block_cost(model, 0) == 0.0


def test_simulated_view_carries_the_hidden_cache_and_forced_hidden_runs_slower() -> None:
    cfg = EngineConfig(runner="sim", model="opt-13b", num_blocks=64, max_model_len=512)
    times = {}
    for name, policy in (("kv", "vllm"), ("hidden", ForcedHiddenCache(all_hidden))):
        built = build_engine(dataclasses.replace(cfg, policy=policy))
        view = built.engine.state.snapshot(0.0)
        assert hidden_view(view).block_tokens == 32
        assert hidden_view(view).block_cost == hidden_block_cost(make_cost_model("measured", OPT13B, A100), 32)
        for i in range(4):
            built.engine.add_request(f"r{i}", list(range(1, 301)), SamplingParams(max_tokens=50, ignore_eos=True))
        while built.engine.has_unfinished:
            built.engine.step()
            built.engine.state.check_invariants()
        times[name] = built.clock.now()
    assert times["hidden"] > times["kv"]


@pytest.mark.parametrize("model, tp, tokens", [("opt-13b", 1, 32), ("opt-30b", 2, 16), ("opt-66b", 4, 8)])
def test_hidden_rows_stay_whole_on_every_gpu(model: str, tp: int, tokens: int) -> None:
    """Each GPU keeps whole hidden rows beside its 1/tp of the K/V pages: Apt-Serve's OPT-30B on
    2 and OPT-66B on 4 GPUs get no hidden-cache saving (a block holds block_size or fewer)."""
    built = build_engine(EngineConfig(model=model, runner="sim", hardware="a100-40g",
                                      tensor_parallel_size=tp))
    view = built.engine.state.snapshot(0.0)
    assert hidden_view(view).block_tokens == tokens
    assert hidden_view(view).block_cost > 0
