"""The simulator's tensor parallelism: ring all-reduce pricing, two a layer, host links shared
by GPU pairs, KV capacity summed over the group, LayerKV's copies waiting for all-reduces on
a PCIe-only server (LayerKV Section 3.1.3), and the simulated engine built from the option."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.builder import build_engine, sim_cost_model
from jserve.cache.sizing import block_bytes
from jserve.config import EngineConfig
from jserve.cache_features.layer_offload.batch import LayerTraffic
from jserve.runners.cost_model import ALLREDUCES_PER_LAYER, RooflineCostModel, StepShape, overlap_layers
from jserve.runners.engine_overhead import KERNELS_ONLY
from jserve.runners.hardware import NVLINK3, PCIE4, Interconnect, get_hardware, kv_capacity_blocks
from jserve.models.registry import get_config

OPT175B = get_config("opt-175b")
LLAMA70B = get_config("llama-3.1-70b")
A100 = get_hardware("a100-80g")
L20 = get_hardware("l20")


def test_ring_allreduce_time():
    link = Interconnect("pcie", bandwidth=10e9, step_latency=1e-6, call_latency=5e-6)
    assert link.allreduce_time(1e9, 1) == 0
    # 4 GPUs: 6 steps, each GPU sends 6/4 of the tensor
    assert link.allreduce_time(1e9, 4) == pytest.approx(1.5 * 1e9 / 10e9 + 6e-6 + 5e-6)
    assert NVLINK3.allreduce_time(1e8, 8) < PCIE4.allreduce_time(1e8, 8)
    with pytest.raises(ValueError, match="nvlink' or 'pcie"):
        Interconnect("infiniband", 1e9, 0)


def test_two_allreduces_a_layer_of_the_steps_hidden_states():
    m = RooflineCostModel(OPT175B, A100, tensor_parallel=8)
    shape = StepShape.decode([512] * 64)
    one = A100.interconnect.allreduce_time(64 * OPT175B.hidden_size * 2, 8)
    assert m.allreduce_time(shape) == pytest.approx(one)
    assert ALLREDUCES_PER_LAYER == 2
    assert m.communication_time(shape) == pytest.approx(2 * OPT175B.num_layers * one)
    assert m.breakdown(shape)["allreduce"] == m.communication_time(shape)
    # serial with the compute: the step is the single-GPU work over 8 plus the all-reduces
    solo = RooflineCostModel(OPT175B, A100, engine=KERNELS_ONLY)
    tp8 = RooflineCostModel(OPT175B, A100, tensor_parallel=8, engine=KERNELS_ONLY)
    assert tp8.step_time(shape) == pytest.approx(solo.step_time(shape) / 8 + tp8.communication_time(shape))
    # a padded step all-reduces its padding too
    padded = dataclasses.replace(shape, padded_tokens=128)
    assert m.allreduce_time(padded) == pytest.approx(A100.interconnect.allreduce_time(128 * OPT175B.hidden_size * 2, 8))
    assert RooflineCostModel(OPT175B, A100).communication_time(shape) == 0


def test_gpu_pairs_share_a_host_link_on_the_layerkv_testbed():
    assert [L20.host_links(n) for n in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [A100.host_links(n) for n in (1, 2, 8)] == [1, 2, 8]
    rates = [RooflineCostModel(LLAMA70B, L20, tensor_parallel=n).pcie_rate for n in (1, 2, 4)]
    assert rates == [L20.pcie_bandwidth, L20.pcie_bandwidth, 2 * L20.pcie_bandwidth]


def test_kv_capacity_is_summed_over_the_group_less_each_gpus_overheads():
    per_block = block_bytes(LLAMA70B, 16, 2)
    for tp in (4, 8):
        blocks = kv_capacity_blocks(LLAMA70B, L20, 16, tensor_parallel=tp)
        free = 0.9 * tp * L20.memory_bytes - LLAMA70B.num_params * 2
        assert blocks * per_block < free  # less the activation and per-GPU reserves
        assert free - blocks * per_block < 1.1 * tp * 2**30  # which are under ~1 GiB a GPU
    with pytest.raises(ValueError, match=r"tensor-parallel-size\) >= 4"):
        kv_capacity_blocks(LLAMA70B, L20, 16, tensor_parallel=2)


def test_copies_wait_for_allreduces_only_on_a_shared_link():
    # two layers of 1 s compute then 1 s all-reduce; a layer brought back takes 3 s of link
    before = np.array([3.0, 3.0])
    zeros = np.zeros(2)
    # NVLink: the second copy runs under the first layer's compute and all-reduce: 3+3, then 2
    assert overlap_layers(2.0, before, zeros, zeros, allreduce=1.0) == pytest.approx(8.0)
    # PCIe: it pauses during the all-reduce [4, 5] and ends at 7, then 1 + 1
    assert overlap_layers(2.0, before, zeros, zeros, allreduce=1.0, shared_link=True) == pytest.approx(9.0)
    # a prefill's write of a layer starts once it computed and waits out its all-reduce
    write = np.array([2.0])
    assert overlap_layers(1.0, np.zeros(1), np.zeros(1), write, allreduce=1.0) == pytest.approx(3.0)
    assert overlap_layers(1.0, np.zeros(1), np.zeros(1), write, allreduce=1.0,
                          shared_link=True) == pytest.approx(4.0)
    # without all-reduces sharing changes nothing
    assert (overlap_layers(2.0, before, zeros, zeros, shared_link=True)
            == overlap_layers(2.0, before, zeros, zeros) == pytest.approx(7.0))


def test_layerkv_offload_contends_with_allreduce_on_pcie_not_on_nvlink():
    """The same prefill writing every layer's K/V to host, on the L20 server (PCIe) and on an
    L20 given an NVLink of PCIe's speed: only the former's copies wait for the all-reduces."""
    nvlink_l20 = dataclasses.replace(L20, interconnect=dataclasses.replace(PCIE4, kind="nvlink"))
    layers = LLAMA70B.num_layers
    per_layer = 4096 * 2 * LLAMA70B.num_kv_heads * LLAMA70B.head_dim * 2
    zeros = (0,) * layers
    shape = dataclasses.replace(StepShape.prefill(4096), layer_bytes=LayerTraffic(
        (per_layer,) * layers, zeros, zeros, zeros))
    pcie = RooflineCostModel(LLAMA70B, L20, tensor_parallel=4)
    nvlink = RooflineCostModel(LLAMA70B, nvlink_l20, tensor_parallel=4)
    assert pcie.communication_time(shape) == nvlink.communication_time(shape) > 0
    assert pcie.step_time(shape) > nvlink.step_time(shape)
    plain = dataclasses.replace(shape, layer_bytes=None)
    assert pcie.step_time(plain) == nvlink.step_time(plain)


def test_simulated_engine_takes_the_group_and_refuses_weights_that_do_not_fit():
    with pytest.raises(ValueError, match=r"opt-175b .* does not fit on 4 x a100-80g.*>= 5"):
        EngineConfig(runner="sim", model="opt-175b", tensor_parallel_size=4)
    config = EngineConfig(runner="sim", model="opt-175b", tensor_parallel_size=8, swap_space=1)
    built = build_engine(config)
    state = built.engine.state
    assert state.blocks.num_blocks == kv_capacity_blocks(OPT175B, A100, 16, tensor_parallel=8)
    # swap space is per GPU (vLLM's): 1 GiB on each of 8 holds 8 GiB of whole blocks
    assert state.host_blocks.num_blocks == int(8 * 2**30 // block_bytes(OPT175B, 16, 2))
    assert sim_cost_model(config).tensor_parallel == 8
    r = run_benchmark(BenchConfig(config, workload="fixed:256:16", num_requests=8, rate=4.0), progress=False)
    assert r.summary.num_finished == 8
