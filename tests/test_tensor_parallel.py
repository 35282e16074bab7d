"""Tensor parallelism on forced CPU devices: greedy ids over 2 and 4 devices equal one
device's for tiny Llama (GQA, KV heads repeated at 4 devices), tiny Llama MHA and tiny OPT,
under recompute preemption and under swapping (the Pallas kernels per shard too, interpreted)
and LayerKV's layer offload (tiny Llama over 4 devices), and each compiled step has exactly
two all-reduces per layer and no other collective; across two processes (multi-host as on
several machines, here local), the same ids.

The checks run in a subprocess per model, started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (`tensor_parallel_checks.py`; JAX fixes
its devices at start-up); these tests read its results. The multi-process check starts two
more. Mapping sharding specs by parameter path is checked here, in-process.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import pytest
from flax import nnx

from jserve import LLM
from jserve.runners.sharding import AXIS, param_spec, sharded_config
from jserve.models.loading import LoadedModel, load_model
from jserve.models.registry import get_config

CHECKS = Path(__file__).with_name("tensor_parallel_checks.py")
sys.path.insert(0, str(CHECKS.parent))
from conftest import forced_cpu_devices_env
from tensor_parallel_checks import ACROSS_TOKENS, across_processes_prompts, greedy


# tiny-llama carries every kind of check (GQA with KV heads repeated, the Pallas kernels per
# shard, LayerKV); MHA and OPT repeat the greedy and collective checks on their shapes, in
# `bench/nightly.sh` (about two minutes of compiling in the subprocess).
MODELS = ["tiny-llama", pytest.param("tiny-llama-mha", marks=pytest.mark.slow),
          pytest.param("tiny-opt", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def results() -> Callable[[str], list[dict]]:
    """One model's checks, run on first request: a process per model, so that the tests
    selected pay only for the models they read."""
    runs: dict[str, list[dict]] = {}

    def of(model: str) -> list[dict]:
        if model not in runs:
            run = subprocess.run([sys.executable, str(CHECKS), model], check=False,
                                 env=forced_cpu_devices_env(4), capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-4000:]
            runs[model] = json.loads(run.stdout.strip().splitlines()[-1])
        return runs[model]

    return of


@pytest.mark.parametrize("model", MODELS)
def test_greedy_ids_identical_to_one_device_under_preemption_and_swap(results: Callable[[str], list[dict]],
                                                                      model: str) -> None:
    runs = [r for r in results(model) if r["policy"] != "layerkv"]
    assert {r["tp"] for r in runs} == {2, 4}
    for r in runs:
        assert r["identical"], r
        assert r["preemptions"] > 0 and r["all_freed"], r
        assert (r["swaps"] == r["preemptions"]) if r["policy"] == "vllm-swap" else r["swaps"] == 0, r


def test_pallas_kernels_run_per_shard(results: Callable[[str], list[dict]]) -> None:
    [r] = [r for r in results("tiny-llama") if r["attention"] == "pallas-interpret"]
    assert r["identical"] and r["swaps"] > 0 and r["tp"] == 4


def test_layerkv_offloads_and_brings_back_sharded_layers(results: Callable[[str], list[dict]]) -> None:
    [r] = [r for r in results("tiny-llama") if r["policy"] == "layerkv"]
    assert r["identical"] and r["moved"]["prefills"] and r["moved"]["to_device"], r


@pytest.mark.parametrize("model", MODELS)
def test_each_step_has_two_all_reduces_per_layer_and_nothing_else(results: Callable[[str], list[dict]],
                                                                  model: str) -> None:
    """After attention's output projection and after the MLP's down projection, in the
    layer loop's body (the program holds the layer once); the logits need none (embeddings
    and LM head replicated)."""
    for r in results(model):
        assert r["collectives"], r
        for ops in r["collectives"]:
            assert ops == {"all-reduce": 2}, r


def test_across_two_processes_identical_to_one_device(tiny_loaded: LoadedModel) -> None:
    """Multi-host as it runs on several machines, here two local processes of two CPU
    devices each (gloo collectives): process 0's engine loop feeds the step of both, swaps
    included, and its greedy ids equal a single-device run's."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(CHECKS), "--across-processes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**forced_cpu_devices_env(2), "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                        "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["processes"] == 2 and got["swaps"] > 0 and "ids" not in outs[1][0]  # the follower printed nothing
    llm = LLM(tiny_loaded, policy="vllm-swap", num_blocks=12, block_size=4, max_model_len=48, warmup=False)
    assert got["ids"] == greedy(llm, across_processes_prompts(tiny_loaded.config.vocab_size), ACROSS_TOKENS)


def test_specs_by_parameter_path() -> None:
    """Megatron-style: q/k/v and gate/up (and OPT's biases of those) split on their output
    dimension, o/down on their input dimension, everything else replicated; the blocks'
    stacked layer axis is never split."""
    for name in ("tiny-llama", "tiny-opt"):
        _, state = nnx.split(load_model(name, seed=0).model)
        specs = {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path[:-1]): param_spec(path)
                 for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        split = {k: s for k, s in specs.items() if s != jax.sharding.PartitionSpec()}
        column = {"wq", "wk", "wv", "w_gate", "w_up"} if name == "tiny-llama" else {"q_proj", "k_proj", "v_proj", "fc1"}
        row = {"wo", "w_down"} if name == "tiny-llama" else {"out_proj", "fc2"}
        expected = {f"layers/{m}/kernel": (None, None, AXIS) for m in column}
        expected |= {f"layers/{m}/kernel": (None, AXIS, None) for m in row}
        if name == "tiny-opt":
            expected |= {f"layers/{m}/bias": (None, AXIS) for m in column}
        assert {k: tuple(s) for k, s in split.items()} == expected


def test_kv_heads_repeated_only_when_fewer_than_devices() -> None:
    gqa = get_config("tiny-llama")  # 4 heads, 2 KV heads
    assert sharded_config(gqa, 2) is gqa
    assert sharded_config(gqa, 4).num_kv_heads == 4
    with pytest.raises(ValueError, match="num_heads=4 does not split"):
        sharded_config(gqa, 3)
    assert sharded_config(get_config("llama-3.1-70b"), 16).num_kv_heads == 16
