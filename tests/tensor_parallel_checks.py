"""Tensor-parallel checks, run in a process of its own with forced CPU devices (JAX fixes the
device count when it starts, so the pytest process, with one, cannot run them):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/tensor_parallel_checks.py [MODEL ...]

Models default to all of `MODELS`.
With `--across-processes`, one of two processes of the same check across processes
(`across_processes`). Prints one JSON object: per model, tensor-parallel size and cache pressure (recompute
preemptions, swaps), whether greedy ids equal the single-device roomy run's, the
preemption and swap counts, and the collectives in each compiled step's HLO.
`tests/test_tensor_parallel.py` runs it once per model its selected tests need and asserts on
the result.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from layer_offload_policy import identical_to_roomy_run

from jserve import LLM, SamplingParams
from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.policies.layerkv import LayerKVPolicy
from jserve.runners import multihost
from jserve.models.loading import load_model

MODELS = ("tiny-llama", "tiny-llama-mha", "tiny-opt")
MAX_TOKENS, MAX_LEN = 40, 48
ACROSS_TOKENS = 12
# The tight cache of tests/test_engine_greedy.py: 12 blocks of 4 tokens, two or three
# sequences at a time, so growth preempts.
TIGHT = dict(num_blocks=12, block_size=4, max_model_len=MAX_LEN, warmup=False)
COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
                        r"(?:-start)?\(")


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, size=n).tolist() for n in [7, 12, 30, 9, 21, 15, 4, 33]]


def across_processes_prompts(vocab: int) -> list[list[int]]:
    """The four longest prompts: still preempted on the tight cache, in fewer steps (a step
    across processes waits for gloo's all-reduces, ~0.1 s on this machine's CPUs)."""
    return sorted(prompts(vocab), key=len)[-4:]


def greedy(llm: LLM, ps: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [o.token_ids for o in outs]


def collectives(llm: LLM) -> list[dict[str, int]]:
    """Collective ops in each step the runner compiled."""
    return [dict(collections.Counter(COLLECTIVE.findall(exe.as_text())))
            for exe in llm.runner._executables.values()]


def check(loaded, ps, expected, tp: int, policy: str, attention: str = "reference") -> dict:
    t0 = time.perf_counter()
    llm = LLM(loaded, policy=policy, tensor_parallel_size=tp, attention=attention, **TIGHT)
    got = greedy(llm, ps)
    state = llm.engine.state
    return dict(model=loaded.config.name, layers=loaded.config.num_layers, tp=tp, policy=policy,
                attention=attention, identical=got == expected,
                preemptions=llm.num_preemptions, swaps=llm.engine.stats.num_swaps,
                all_freed=state.blocks.num_free == TIGHT["num_blocks"] and len(llm.runner.host_kv) == 0,
                collectives=collectives(llm), seconds=round(time.perf_counter() - t0, 2))


def layerkv(loaded, ps: list[list[int]]) -> dict:
    """LayerKV on the tight cache over 4 devices: layers offloaded at prefill and brought
    back through the per-layer host pool, each shard its own heads (as test_layerkv_greedy)."""
    costs = LayerKVCosts(num_params=1e6, hidden_size=64, kv_dim=32, dtype_bytes=4, flops=2e9, pcie_bandwidth=1e12)
    llm = LLM(loaded, policy=LayerKVPolicy(costs=costs), tensor_parallel_size=4, swap_space=0.001, **TIGHT)
    moved = identical_to_roomy_run(llm, loaded, ps, MAX_TOKENS, MAX_LEN)  # asserts the ids
    return dict(model=loaded.config.name, layers=loaded.config.num_layers, tp=4, policy="layerkv",
                attention="reference", identical=True, moved=moved, collectives=collectives(llm))


def main(models: list[str]) -> None:
    results = []
    for name in models:
        loaded = load_model(name, seed=0)
        ps = prompts(loaded.config.vocab_size)
        roomy = greedy(LLM(loaded, num_blocks=512, warmup=False), ps)
        expected = [e[: MAX_LEN - len(p)] for e, p in zip(roomy, ps)]
        # Each size once, under each kind of preemption: 2 devices recompute, 4 swap.
        results += [check(loaded, ps, expected, 2, "vllm"), check(loaded, ps, expected, 4, "vllm-swap")]
        if name == "tiny-llama":  # the Pallas kernels per shard, KV heads repeated (kv=2 < 4)
            # on the four longest prompts: still swapped, with fewer interpreted steps to build
            few = across_processes_prompts(loaded.config.vocab_size)
            results.append(check(loaded, few, [expected[ps.index(p)] for p in few], 4, "vllm-swap",
                                 "pallas-interpret"))
            results.append(layerkv(loaded, ps))
    print(json.dumps(results))


def across_processes() -> None:
    """One process of a multi-process run (`JAX_COORDINATOR_ADDRESS` etc. set by the caller):
    tiny-llama over 4 devices of 2 processes on the tight cache with swaps; process 0 prints
    the ids, the other follows its steps and exits while building the engine."""
    multihost.initialize()
    loaded = load_model("tiny-llama", seed=0)
    llm = LLM(loaded, policy="vllm-swap", tensor_parallel_size=4, **TIGHT)
    print(json.dumps(dict(ids=greedy(llm, across_processes_prompts(loaded.config.vocab_size), ACROSS_TOKENS),
                          swaps=llm.engine.stats.num_swaps, processes=jax.process_count())))


if __name__ == "__main__":
    across_processes() if sys.argv[1:] == ["--across-processes"] else main(sys.argv[1:] or list(MODELS))
