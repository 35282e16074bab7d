"""Greedy token ids with layer-wise residency forced on (LayerKV's mechanics on the real JAX
runner: offloaded layers' prefill K/V written to the per-layer host pool, brought back into
device blocks before decoding, kept layers copied from slots into whole blocks, retained
layers offloaded, decodes reading offloaded layers from the host) equal an unconstrained run's, on the tiny Llama (reference and
interpreted-kernel backends) and SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
from layer_offload_policy import (
    ForcedLayerOffload,
    identical_to_roomy_run,
    random_prompts,
)

from jserve import LLM
from jserve.cache_features.layer_offload.steps import LayerSteps
from jserve.models.loading import LoadedModel


def _none(seq: int, num_layers: int) -> int:
    return 0


def _mixed(seq: int, num_layers: int) -> int:
    return seq % (num_layers + 1)


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
@pytest.mark.parametrize("keep, name", [(_none, "every layer offloaded"), (_mixed, "mixed")])
def test_tiny_model_identical_with_layers_offloaded(tiny_loaded: LoadedModel, attention: str, keep, name: str) -> None:
    prompts = random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33])
    policy = ForcedLayerOffload(keep=keep, offload_running=True, reshuffle=name == "mixed")
    tight = LLM(tiny_loaded, policy=policy, num_blocks=12, block_size=4, max_model_len=48,
                attention=attention, warmup=False, swap_space=0.001)
    seen = identical_to_roomy_run(tight, tiny_loaded, prompts, 40, 48)
    print(f"tiny model, {attention}, {name}: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["prefills"] and seen["to_device"]
    if name == "mixed":  # some prefills keep every layer, then are offloaded while decoding
        assert seen["to_host"] and seen["copies"]


def layers(runner: object) -> LayerSteps:
    """The runner's layer-offload side (its staging rows and host pool)."""
    return next(f for f in runner.features if isinstance(f, LayerSteps))


@pytest.mark.parametrize("narrow", [False, True])
def test_tiny_model_identical_decoding_with_layers_on_the_host(tiny_loaded: LoadedModel, narrow: bool) -> None:
    """Partly offloaded requests decode with their host layers read for each step (LayerKV
    Section 4), some also moving between residencies while they do. `narrow`: staging rows
    for 12 blocks, one sequence's longest context, so a step whose partly offloaded
    sequences need more runs them in groups."""
    prompts = random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33])
    policy = ForcedLayerOffload(keep=_mixed, offload_running=True, reshuffle=True, host_decodes=True)
    tight = LLM(tiny_loaded, policy=policy, num_blocks=24, block_size=4, max_model_len=48,
                attention="reference", warmup=False, swap_space=0.001)
    runner, groups, steps = tight.runner, [], []
    if narrow:  # the top 12 of the staging rows
        layers(runner).staging_start = runner.scratch_block - 12
    compute, execute = runner._compute, runner.execute
    runner._compute = lambda batch: groups.append(batch.num_seqs) or compute(batch)
    runner.execute = lambda batch: steps.append(batch.num_seqs) or execute(batch)
    seen = identical_to_roomy_run(tight, tiny_loaded, prompts, 40, 48)
    print(f"tiny model, host decodes, narrow {narrow}: {tight.num_preemptions} preemptions, moves {seen}, "
          f"{len(groups)} computes of {sum(n > 0 for n in steps)} steps")
    assert seen["prefills"] and seen["host_decodes"]
    assert (len(groups) > sum(n > 0 for n in steps)) == narrow


@pytest.mark.slow  # ~50-100 s; CI: the tiny model's residencies above
def test_smollm2_identical_with_mixed_residencies(smollm2_loaded: LoadedModel) -> None:
    tok = smollm2_loaded.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain in one sentence what a hash table is."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in chats]
    policy = ForcedLayerOffload(keep=_mixed, offload_running=True, reshuffle=True)
    tight = LLM(smollm2_loaded, policy=policy, num_blocks=10, warmup=False, swap_space=0.01)
    seen = identical_to_roomy_run(tight, smollm2_loaded, prompts, 12, tight.engine.state.limits.max_model_len)
    print(f"smollm2, mixed: {tight.num_preemptions} preemptions, moves {seen}")
    assert seen["prefills"] and seen["to_host"] and seen["to_device"] and seen["copies"]


def test_warmup_compiles_layered_prefill_variants_only_for_an_offloading_policy(tiny_loaded: LoadedModel) -> None:
    plain = LLM(tiny_loaded, num_blocks=32, warmup=False)
    plain.runner.warmup(shapes=[16])
    assert set(plain.runner._executables) == {(16, False, None)}
    offloading = LLM(tiny_loaded, policy=ForcedLayerOffload(), num_blocks=32, warmup=False, swap_space=0.001)
    offloading.runner.warmup(shapes=[16])
    assert set(offloading.runner._executables) == {(16, False, None), (16, False, "layer_offload")}


def test_warmup_compiles_every_layer_copy_and_writes_only_the_scratch_block(tiny_loaded: LoadedModel) -> None:
    """After warm-up a run compiles no layer copy (they used to compile inside the first
    offloading steps), and warm-up's copies touch nothing but the scratch block."""
    offloading = LLM(tiny_loaded, policy=ForcedLayerOffload(keep=_mixed, offload_running=True, reshuffle=True),
                     num_blocks=12, block_size=4, max_model_len=48, warmup=False, swap_space=0.001)
    runner = offloading.runner
    scratch = runner.scratch_block
    before = [np.asarray(p) for p in (runner.cache.k, runner.cache.v)]
    runner.warmup(shapes=[16])
    after = [np.asarray(p) for p in (runner.cache.k, runner.cache.v)]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.delete(b, scratch, axis=1), np.delete(a, scratch, axis=1))
    pool = layers(runner).pool
    compiled = pool._gather._cache_size(), pool._scatter._cache_size()
    prompts = random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15])
    seen = identical_to_roomy_run(offloading, tiny_loaded, prompts, 40, 48)
    assert seen["prefills"] and seen["to_host"] and seen["to_device"] and seen["copies"]
    assert (pool._gather._cache_size(), pool._scatter._cache_size()) == compiled
