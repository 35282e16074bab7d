"""The cache-feature seam's own rules (`jserve.cache_features`): the core refuses what no
registered feature owns, and a request is in one feature's own state at a time."""

from __future__ import annotations

import pytest

from jserve.cache_features.hidden_cache.section import CacheType
from jserve.cache_features.hidden_cache.section import section as hidden_section
from jserve.cache_features.layer_offload.section import section as layer_section
from jserve.engine.plan import Plan
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError


def _state(**options: object) -> EngineState:
    state = EngineState(num_blocks=8, block_size=4, limits=SchedulerLimits(4, 64, 64), eos_token_id=None,
                        vocab_size=16, num_host_blocks=8, **options)
    state.add("a", [1] * 6, SamplingParams(max_tokens=4), 0.0)
    return state


def test_an_option_no_feature_takes_is_refused() -> None:
    with pytest.raises(TypeError, match="num_layer"):
        _state(num_layer=4)


def test_a_section_of_no_registered_feature_is_refused() -> None:
    with pytest.raises(PlanError, match="unknown cache features"):
        _state().apply(Plan(run={0: 6}, allocate={0: 2}, features={"nvme_tier": object()}), 0.0)


def test_a_request_is_held_by_one_feature_at_a_time() -> None:
    state = _state(num_layers=2, hidden_block_tokens=8)
    both = {**hidden_section({0: CacheType.HIDDEN}), **layer_section({0: 1})}
    with pytest.raises(PlanError, match="cannot both hold it"):
        state.apply(Plan(run={0: 6}, allocate={0: 1}, features=both), 0.0)
    state.apply(Plan(run={0: 6}, allocate={0: 1}, features=hidden_section({0: CacheType.HIDDEN})), 0.0)
    state.check_invariants()
    view = state.snapshot(0.0)
    assert set(view.features) == {"hidden_cache", "layer_offload"}
