"""Greedy token ids under `policy="layerkv"` on the real JAX runner equal an unconstrained
run's: a cache too small for the prompts makes LayerKV prefill with layers offloaded to the
host, bring them back to decode, and offload retained layers, on the tiny Llama (reference
and interpreted-kernel backends) and on SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.policies.layerkv import LayerKVPolicy
from models.loading import LoadedModel


def _ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def _identical(llm: LLM, loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, max_len: int) -> dict:
    """Outputs equal the roomy vLLM run's and everything is given back; returns the moves."""
    roomy = LLM(loaded, num_blocks=512, warmup=False)
    expected = [e[: max_len - len(p)] for e, p in zip(_ids(roomy, prompts, max_tokens), prompts)]
    seen = {"partial_prefills": 0, "to_host": 0, "to_device": 0}
    execute = llm.runner.execute

    def counting(batch):
        seen["partial_prefills"] += len(batch.inputs.layer_tables)
        seen["to_host"] += len(batch.layers_to_host)
        seen["to_device"] += len(batch.layers_to_device)
        return execute(batch)

    llm.runner.execute = counting
    assert _ids(llm, prompts, max_tokens) == expected
    state = llm.engine.state
    assert state.blocks.num_free == state.blocks.num_blocks and not state.residency.partial
    return seen


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
def test_tiny_model_identical_under_layerkv(tiny_loaded: LoadedModel, attention: str) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, tiny_loaded.config.vocab_size, size=n).tolist() for n in [7, 12, 30, 9, 21, 15, 4, 33]]
    # Eq. 3 at ~1 ms a token with a link that hides every layer: x_min = 0, and each
    # prompt's prefill counts against the TPOT SLO the requests carry below
    costs = LayerKVCosts(num_params=1e6, hidden_size=64, kv_dim=32, dtype_bytes=4, flops=2e9, pcie_bandwidth=1e12)
    tight = LLM(tiny_loaded, policy=LayerKVPolicy(costs=costs), num_blocks=12, block_size=4, max_model_len=48,
                attention=attention, warmup=False, swap_space=0.001)
    seen = _identical(tight, tiny_loaded, prompts, 40, 48)
    print(f"tiny model, layerkv, {attention}: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["partial_prefills"] and seen["to_device"]


def test_smollm2_identical_under_layerkv(smollm2_loaded: LoadedModel) -> None:
    tok = smollm2_loaded.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain in one sentence what a hash table is."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in chats]
    tight = LLM(smollm2_loaded, policy="layerkv", num_blocks=6, warmup=False, swap_space=0.01)
    seen = _identical(tight, smollm2_loaded, prompts, 12, tight.engine.state.limits.max_model_len)
    print(f"smollm2, layerkv: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["partial_prefills"]
