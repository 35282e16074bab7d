"""`build_engine`: one configuration makes the real engine or the simulated one, and hands a
policy that prices preemption its costs from a profile of the runner in use."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from jserve import LLM, RequestOutput, SamplingParams
from jserve.builder import build_engine
from jserve.cache_features.layer_offload.steps import LayerSteps
from jserve.cache.sizing import block_bytes, num_blocks_for_budget
from jserve.config import EngineConfig
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine
from jserve.engine.preemption_costs import PreemptionCosts
from jserve.policies.cacheopt import CacheOptPolicy
from jserve.runners.cost_model import CalibratedCostModel, RooflineCostModel, SwapPath
from jserve.runners.hardware import get_hardware
from jserve.runners.jax_runner import JaxRunner
from jserve.runners.measured_cost import MeasuredCostModel
from jserve.runners.preemption_cost import preemption_costs_from_cost_model
from jserve.runners.profiling import HiddenProjectionProfile, save_hidden_profile
from jserve.runners.sim_runner import SimRunner
from jserve.runners.testbeds import make_cost_model
from jserve.models.registry import get_config

TINY = EngineConfig(model="tiny-llama", weights="dummy", num_blocks=32, block_size=4,
                    max_model_len=64, max_num_seqs=4, warmup=False)


def _tokens_of_one_request(engine: Engine) -> int:
    """How many tokens a request for 4 generates, run to its end."""
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = []
    while engine.has_unfinished:
        outputs += [RequestOutput.of(r) for r in engine.step()]
    return len(outputs[-1].token_ids)


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A step-time profile as `jserve profile` writes one (made-up coefficients)."""
    path = tmp_path_factory.mktemp("profile") / "p.json"
    CalibratedCostModel((2e-3, 1e-5, 2e-5, 1e-5, 1e-9, 1e-9, 0.0, 0.0)).save(path)
    return str(path)


def test_real_engine_on_the_tiny_model() -> None:
    built = build_engine(TINY)
    state = built.engine.state
    assert isinstance(built.runner, JaxRunner) and isinstance(built.clock, WallClock)
    assert built.loaded is not None and built.tokenizer is None  # dummy weights: ids only
    assert (state.blocks.num_blocks, state.limits) == (32, TINY.limits)
    model = get_config("tiny-llama")  # float32 on CPU: 4 bytes a value
    assert state.host_blocks.num_blocks == num_blocks_for_budget(model, 4, 4, 4 * 2**30)
    assert state.prefix is None and built.engine.eviction is None
    assert _tokens_of_one_request(built.engine) == 4


def test_real_engine_with_a_prefix_cache_and_a_loaded_model(tiny_loaded) -> None:
    built = build_engine(dataclasses.replace(TINY, model=tiny_loaded, prefix_cache="lru"))
    assert built.loaded is tiny_loaded and built.model_config is tiny_loaded.config
    assert built.engine.state.prefix is not None and built.engine.eviction.name == "lru"


def test_real_engine_prices_preemption_only_from_a_profile(profile: str) -> None:
    cfg = dataclasses.replace(TINY, policy="cacheopt")
    assert build_engine(cfg).engine.policy.preemption_costs is None  # the policy's fallback
    costs = build_engine(dataclasses.replace(cfg, profile=profile)).engine.policy.preemption_costs
    model = get_config("tiny-llama")
    swaps = RooflineCostModel(model, get_hardware("a100-80g"), dtype_bytes=4, swap_path=SwapPath.GATHERED)
    assert costs == preemption_costs_from_cost_model(
        CalibratedCostModel.load(profile, extras=swaps), 4, block_bytes(model, 4, 4))


def test_simulated_engine_from_the_same_config() -> None:
    cfg = EngineConfig(runner="sim", model="opt-13b", policy="cacheopt")
    built = build_engine(cfg)
    assert isinstance(built.runner, SimRunner) and isinstance(built.clock, VirtualClock)
    assert built.loaded is None and built.runner.pad is None  # vLLM pads nothing
    model, hw = get_config("opt-13b"), get_hardware("a100-80g")
    measured = make_cost_model("measured", model, hw)
    assert isinstance(built.runner.cost_model, MeasuredCostModel)  # vLLM as measured, by default
    assert built.engine.policy.preemption_costs == preemption_costs_from_cost_model(
        measured, cfg.block_size, block_bytes(model, cfg.block_size, 2))
    assert built.engine.state.limits == cfg.limits
    assert _tokens_of_one_request(build_engine(dataclasses.replace(cfg, num_blocks=64)).engine) == 4


def test_simulator_with_a_profile_pads_like_the_jax_runner(profile: str) -> None:
    built = build_engine(EngineConfig(runner="sim", model="tiny-llama", profile=profile))
    assert isinstance(built.runner.cost_model, CalibratedCostModel) and built.runner.pad(5) == 16


def test_a_policy_keeps_the_costs_it_was_given() -> None:
    own = PreemptionCosts(a=1e-6, b=2.0, k=0.0, e=1e-3, g=2e-5, d=2e-3)
    cfg = EngineConfig(runner="sim", model="opt-13b", policy=CacheOptPolicy(preemption_costs=own))
    assert build_engine(cfg).engine.policy.preemption_costs is own


def test_llm_takes_keywords_or_a_whole_config(tiny_loaded) -> None:
    llm = LLM(tiny_loaded, num_blocks=16, max_model_len=64, warmup=False)
    assert llm.engine_config == EngineConfig(model=tiny_loaded, num_blocks=16, max_model_len=64,
                                             warmup=False)
    assert LLM(llm.engine_config).engine.state.blocks.num_blocks == 16
    with pytest.raises(TypeError, match="takes no other options"):
        LLM(llm.engine_config, policy="s3")
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_block'"):
        LLM(tiny_loaded, num_block=16)
    with pytest.raises(ValueError, match="runner='real'"):
        LLM(EngineConfig(runner="sim", model="tiny-llama"))


def test_real_engine_reads_apt_serve_rho_only_from_a_profile(profile: str, tmp_path) -> None:
    """rho (the view's `hidden_block_cost`) is the profile's hidden-cache entry per block of
    the model's hidden rows; a profile without one, or none, leaves it unknown (0.0)."""
    cfg = dataclasses.replace(TINY, policy="apt-serve")
    assert build_engine(cfg).engine.state.feature("hidden_cache").cost == 0.0
    assert build_engine(dataclasses.replace(cfg, profile=profile)).engine.state.feature("hidden_cache").cost == 0.0
    with_hidden = tmp_path / "p.json"
    with_hidden.write_text(pathlib.Path(profile).read_text())
    entry = HiddenProjectionProfile((64, 256, 1024), (2e-4, 5e-4, 1.7e-3))
    save_hidden_profile(with_hidden, entry)
    state = build_engine(dataclasses.replace(cfg, profile=str(with_hidden))).engine.state
    hidden = state.feature("hidden_cache")
    assert hidden.cost == pytest.approx(entry.block_cost(hidden.tokens))
    assert entry.per_row == pytest.approx(1.5e-3 / 960, rel=0.05)


# LayerKV's pool at 0.01 GiB: one of 4 GiB is mapped (zeroed) when made, 4-9 s of a test.
@pytest.mark.parametrize("policy,swap_space,pooled", [("vllm", 4.0, False), ("vllm-swap", 4.0, False),
                                                       ("layerkv", 0.01, True), ("layerkv", 0.0, False)])
def test_host_memory_is_paid_for_only_where_the_policy_keeps_layers_there(
        policy: str, swap_space: float, pooled: bool) -> None:
    """The per-layer host pool (mapped when made) exists only for a policy that offloads
    layers (LayerKV) with swap space; swap preemption holds each swapped request's blocks
    in a buffer of its own, so no host memory is held before a swap."""
    built = build_engine(dataclasses.replace(TINY, policy=policy, swap_space=swap_space))
    runner = built.engine.runner
    pools = [f.pool for f in runner.features if isinstance(f, LayerSteps)]
    assert bool(pools) == pooled
    assert len(runner.host_kv) == 0
    if pooled:
        host_blocks = built.engine.state.host_blocks.num_blocks
        assert pools[0].k[0].shape[0] == host_blocks > 0


def test_layerkv_host_tier_is_sized_from_the_host_by_default() -> None:
    """Without `swap_space` a policy that keeps layers on the host gets room for
    `max_num_seqs` sequences of `max_model_len` tokens (the simulated host, as the paper's
    2 TB server); on a real host at most a quarter of its memory, refused below one such
    request; others get vLLM's 4 GiB; a given `swap_space` is per device, as vLLM's."""
    from jserve.builder import host_tier_bytes
    from jserve.policies import POLICIES

    cfg = EngineConfig(runner="sim", model="llama-2-7b", hardware="l20", policy="layerkv", max_model_len=4096)
    model = cfg.model_config()
    per_token = block_bytes(model, 1, 2)  # 512 KiB for Llama-2-7B in bf16
    state = build_engine(cfg).engine.state
    assert state.host_blocks.num_blocks * 16 == 256 * 4096
    layerkv, vllm = POLICIES["layerkv"](), POLICIES["vllm"]()
    assert host_tier_bytes(cfg, layerkv, model, 2) == 256 * 4096 * per_token
    assert host_tier_bytes(cfg, vllm, model, 2) == 4 * 2**30
    assert host_tier_bytes(dataclasses.replace(cfg, swap_space=2.0, tensor_parallel_size=2), layerkv, model, 2) == 4 * 2**30
    assert host_tier_bytes(cfg, layerkv, model, 2, host_memory=64 * 2**30) == 16 * 2**30
    with pytest.raises(ValueError, match="cannot hold one 4096-token request"):
        host_tier_bytes(cfg, layerkv, model, 2, host_memory=4 * 2**30)
