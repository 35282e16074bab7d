"""Greedy token ids under `policy="layerkv"` on the real JAX runner equal an unconstrained
run's: a cache too small for the prompts makes LayerKV prefill with layers offloaded to the
host, decode with them read from the host at each step (or, `layerkv-whole`, bring them
back to decode), and offload retained layers, on the tiny Llama (reference and
interpreted-kernel backends) and on SmolLM2."""

from __future__ import annotations

import pytest
from layer_offload_policy import identical_to_roomy_run, random_prompts

from jserve import LLM
from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.policies.layerkv import LayerKVPolicy
from jserve.models.loading import LoadedModel


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
def test_tiny_model_identical_under_layerkv(tiny_loaded: LoadedModel, attention: str) -> None:
    prompts = random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33])
    # Eq. 3 at ~1 ms a token with a link that hides every layer: x_min = 0, each prompt's
    # prefill counts against the TPOT SLO the requests carry below, and a 10 ms decode step
    # hides the host reads of decodes with layers on the host
    costs = LayerKVCosts(num_params=1e6, hidden_size=64, kv_dim=32, dtype_bytes=4, flops=2e9, pcie_bandwidth=1e12,
                         decode_base=0.01)
    tight = LLM(tiny_loaded, policy=LayerKVPolicy(costs=costs), num_blocks=12, block_size=4, max_model_len=48,
                attention=attention, warmup=False, swap_space=0.001)
    seen = identical_to_roomy_run(tight, tiny_loaded, prompts, 40, 48)
    print(f"tiny model, layerkv, {attention}: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["prefills"] and seen["host_decodes"]


def test_tiny_model_identical_under_layerkv_whole(tiny_loaded: LoadedModel) -> None:
    """The whole-block return (`layerkv-whole`): offloaded requests come back before decoding."""
    prompts = random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33])
    costs = LayerKVCosts(num_params=1e6, hidden_size=64, kv_dim=32, dtype_bytes=4, flops=2e9, pcie_bandwidth=1e12)
    tight = LLM(tiny_loaded, policy=LayerKVPolicy(costs=costs, decode_from_host=False), num_blocks=12, block_size=4,
                max_model_len=48, attention="reference", warmup=False, swap_space=0.001)
    seen = identical_to_roomy_run(tight, tiny_loaded, prompts, 40, 48)
    print(f"tiny model, layerkv-whole: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["prefills"] and seen["to_device"] and not seen["host_decodes"]


@pytest.mark.slow  # ~40-80 s; CI: the tiny model under LayerKV above
def test_smollm2_identical_under_layerkv(smollm2_loaded: LoadedModel) -> None:
    tok = smollm2_loaded.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain in one sentence what a hash table is."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in chats]
    tight = LLM(smollm2_loaded, policy="layerkv", num_blocks=6, warmup=False, swap_space=0.01)
    seen = identical_to_roomy_run(tight, smollm2_loaded, prompts, 12, tight.engine.state.limits.max_model_len)
    print(f"smollm2, layerkv: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["prefills"]
