"""The cache-feature seam's own rules (`jserve.cache_features`): the core refuses what no
registered feature owns, a request is in one feature's own state at a time, and runners and
backends (the sharded one too) refuse a feature's part they were not built for."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve.cache_features.hidden_cache.batch import HiddenBatch
from jserve.cache_features.hidden_cache.section import NAME, CacheType
from jserve.cache_features.hidden_cache.section import section as hidden_section
from jserve.cache_features.layer_offload.section import section as layer_section
from jserve.cache_features.registry import refuse_unknown_steps
from jserve.engine.batch import Batch
from jserve.engine.plan import Plan
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError
from jserve.pallas_kernels.attention_metadata import AttentionMetadata, ragged_metadata
from jserve.pallas_kernels.backends import select_attention
from jserve.runners.sharding import ShardedAttention, make_mesh


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


def test_a_runner_refuses_a_batch_part_of_a_feature_it_was_not_built_with() -> None:
    batch = Batch(np.arange(1), np.zeros(1, np.int32), np.ones(1, np.int32), np.ones(1, bool),
                  features={NAME: HiddenBatch(np.ones(1, bool))})
    with pytest.raises(RuntimeError, match="hidden_cache sequences.*no hidden_cache steps"):
        refuse_unknown_steps(batch, ())
    refuse_unknown_steps(dataclasses.replace(batch, features={}), ())


def _step_with_a_hidden_part() -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
    """A one-token step's query, pages and metadata, with a hidden-cache part."""
    meta = ragged_metadata(np.zeros(1, np.int32), np.ones(1, np.int32), [np.zeros(1, np.int32)],
                           num_tokens=1, num_seqs=1, max_blocks=1, block_size=4, scratch_block=1)
    x, pages = np.zeros((1, 1, 8), np.float32), np.zeros((2, 4, 1, 8), np.float32)
    return x, pages, dataclasses.replace(meta, parts={NAME: None})


def test_a_paged_backend_refuses_a_step_with_a_features_metadata_part() -> None:
    x, pages, meta = _step_with_a_hidden_part()
    with pytest.raises(ValueError, match=r"paged KV only; a step with \['hidden_cache'\] parts"):
        select_attention("reference")(x, x, x, pages, pages, meta, scale=1.0)


def test_the_sharded_backend_refuses_a_step_with_a_features_metadata_part() -> None:
    """Before any shard runs: the refusal needs no second device (a one-device mesh)."""
    x, pages, meta = _step_with_a_hidden_part()
    with pytest.raises(ValueError, match=r"\['hidden_cache'\] steps do not run under tensor parallelism"):
        ShardedAttention(select_attention("reference"), make_mesh(1))(x, x, x, pages, pages, meta, scale=1.0)
