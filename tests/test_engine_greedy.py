"""Greedy token ids of the paged engine equal a dense, cache-free oracle, with and without
a cache small enough to force recompute preemptions; on a GPU, the compiled Pallas kernels'
ids equal the jnp reference backend's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMOL_ENGINE
from jserve import LLM, SamplingParams
from jserve.policies.fastgen import FastGenPolicy
from jserve.policies.rlp import RLPPolicy
from jserve.policies.s3 import S3Policy
from jserve.policies.sarathi import SarathiPolicy
from jserve.models.dense_reference import dense_greedy_generate
from jserve.models.llama import llama_weights_of
from jserve.models.loading import LoadedModel, load_model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a hash table is.",
]


def _oracle(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    cfg = loaded.config
    weights = llama_weights_of(loaded.model)
    return [dense_greedy_generate(cfg, weights, p, max_tokens, cfg.eos_token_id) for p in prompts]


def _engine_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


def _random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def test_tiny_model_matches_dense_oracle(tiny_loaded: LoadedModel) -> None:
    prompts = _random_prompts(tiny_loaded.config.vocab_size, [1, 5, 16, 17, 40, 3])
    llm = LLM(tiny_loaded, num_blocks=256, warmup=False)
    assert _engine_ids(llm, prompts, 24) == _oracle(tiny_loaded, prompts, 24)
    assert llm.num_preemptions == 0


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
def test_tiny_model_identical_under_preemption(tiny_loaded: LoadedModel, attention: str) -> None:
    """Also the Pallas kernels (interpreted) end to end: ragged prefill, the split-K decode
    kernel on all-decode steps and the KV write, under preemption."""
    prompts = _random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33], seed=1)
    roomy = LLM(tiny_loaded, num_blocks=512, warmup=False)
    # 12 blocks of 4 tokens: two or three sequences at a time, growth forces preemptions.
    tight = LLM(tiny_loaded, num_blocks=12, block_size=4, max_model_len=48, attention=attention,
                warmup=False)
    expected = _engine_ids(roomy, prompts, 40)
    assert _engine_ids(tight, prompts, 40) == [e[: 48 - len(p)] for e, p in zip(expected, prompts)]
    print(f"tiny model, {attention}: {tight.num_preemptions} preemptions")
    assert tight.num_preemptions > 0
    assert tight.engine.state.blocks.num_free == 12


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
def test_tiny_model_identical_when_preempted_by_swapping(tiny_loaded: LoadedModel,
                                                          attention: str) -> None:
    """Swapped-out K/V go to host memory and come back into other blocks bit for bit, so
    greedy outputs equal an unconstrained run's."""
    prompts = _random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33], seed=1)
    roomy = LLM(tiny_loaded, num_blocks=512, warmup=False)
    tight = LLM(tiny_loaded, policy="vllm-swap", num_blocks=12, block_size=4, max_model_len=48,
                attention=attention, warmup=False)
    expected = _engine_ids(roomy, prompts, 40)
    assert _engine_ids(tight, prompts, 40) == [e[: 48 - len(p)] for e, p in zip(expected, prompts)]
    state = tight.engine.state
    print(f"tiny model, vllm-swap, {attention}: {tight.num_preemptions} preemptions")
    assert tight.num_preemptions > 0 and tight.engine.stats.num_swaps == tight.num_preemptions
    assert state.blocks.num_free == 12 and state.host_blocks.num_free == state.host_blocks.num_blocks
    assert len(tight.runner.host_kv) == 0


def _chat_prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]


@pytest.mark.slow  # 80-150 s; CI: test_paris (SmolLM2's ids), the tiny models' oracle tests above
def test_smollm2_matches_dense_oracle_and_survives_preemption(smollm2_loaded: LoadedModel) -> None:
    prompts = _chat_prompts(smollm2_loaded)
    expected = _oracle(smollm2_loaded, prompts, 20)
    roomy = LLM(smollm2_loaded, num_blocks=64, warmup=False)
    assert _engine_ids(roomy, prompts, 20) == expected
    # Each prompt is ~40 tokens (3 blocks); 10 blocks hold about two requests at once.
    tight = LLM(smollm2_loaded, num_blocks=10, warmup=False)
    assert _engine_ids(tight, prompts, 20) == expected
    print(f"smollm2: {tight.num_preemptions} preemptions with a 10-block cache")
    assert tight.num_preemptions > 0


def test_paris(smollm2_loaded: LoadedModel) -> None:
    """SmolLM2's real answer, then cut by a stop string (dropped, or kept with
    include_stop_str_in_output), every block free after."""
    llm = LLM(smollm2_loaded, warmup=False, **SMOL_ENGINE)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [full] = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in full.text
    assert full.finish_reason == "stop"
    m = full.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == len(full.token_ids)
    [cut] = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"]),
                     use_tqdm=False)
    assert cut.text == full.text[: full.text.index("Paris")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    [kept] = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"],
                                           include_stop_str_in_output=True), use_tqdm=False)
    assert kept.text.endswith("Paris")
    assert llm.engine.state.blocks.num_free == SMOL_ENGINE["num_blocks"]


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_and_streaming(tiny_loaded: LoadedModel, max_tokens: int) -> None:
    llm = LLM(tiny_loaded, num_blocks=64, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seen: dict[str, list[int]] = {}
    for out in llm.generate_stream(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params):
        prev = seen.get(out.request_id, [])
        assert out.token_ids[: len(prev)] == prev and len(out.token_ids) == len(prev) + 1
        seen[out.request_id] = out.token_ids
    assert sorted(len(v) for v in seen.values()) == [max_tokens, max_tokens]


def test_seeded_sampling_is_reproducible_across_batches(tiny_loaded: LoadedModel) -> None:
    llm = LLM(tiny_loaded, num_blocks=64, warmup=False)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    [alone] = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    crowd = llm.generate(prompt_token_ids=[[9, 9], [5, 6, 7], [1]],
                         sampling_params=[SamplingParams(temperature=1.0, max_tokens=12), params,
                                          SamplingParams(temperature=0.0, max_tokens=5)],
                         use_tqdm=False)
    assert crowd[1].token_ids == alone.token_ids


@pytest.mark.parametrize("policy", [SarathiPolicy(token_budget=24), FastGenPolicy(token_budget=24)])
def test_chunked_prefill_policies_match_dense_oracle(tiny_loaded: LoadedModel, policy) -> None:
    """Prompts split into chunks that start mid-page, mixed with decodes in one step, and
    preemptions from a tight cache: token ids stay those of the dense oracle."""
    prompts = _random_prompts(tiny_loaded.config.vocab_size, [50, 7, 33, 61, 3, 18], seed=2)
    tight = LLM(tiny_loaded, policy=policy, num_blocks=24, block_size=4, max_model_len=96,
                warmup=False)
    got = _engine_ids(tight, prompts, 30)
    assert got == _oracle(tiny_loaded, prompts, 30)
    print(f"{policy.name}: {tight.num_preemptions} preemptions")
    assert tight.num_preemptions > 0
    assert tight.engine.state.blocks.num_free == 24


@pytest.mark.parametrize("policy, swap_space", [
    ("cacheopt", 4.0), ("cacheopt", 0.0),
    (RLPPolicy(margin_tokens=2), 4.0), (S3Policy(bucket_tokens=4), 4.0),
], ids=["cacheopt-swap", "cacheopt-recompute", "rlp", "s3"])
def test_reserving_policies_identical_on_a_tight_cache(tiny_loaded: LoadedModel, policy,
                                                       swap_space: float) -> None:
    """Prediction-based allocation on the real model: requests are added through
    `engine.add_request` with an under-prediction of 5 output tokens (LLM.generate takes no
    predictions), so reservations run out and requests are extended, preempted and brought
    back on a 12-block cache (CacheOpt swaps when it has a host tier and recomputes without
    one; RLP's margin and S3's buckets are shrunk to this model length, or every reservation
    would be the whole max_len); greedy outputs equal the roomy vLLM run's."""
    prompts = _random_prompts(tiny_loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33], seed=1)
    roomy = LLM(tiny_loaded, num_blocks=512, warmup=False)
    expected = _engine_ids(roomy, prompts, 40)
    tight = LLM(tiny_loaded, policy=policy, num_blocks=12, block_size=4, max_model_len=48,
                warmup=False, swap_space=swap_space)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for k, p in enumerate(prompts):
        tight.engine.add_request(str(k), p, params, predicted_len=5, predicted_dir=-1)
    done = {out.request_id: out.token_ids for out in tight._run() if out.finished}
    assert [done[str(k)] for k in range(len(prompts))] == [e[: 48 - len(p)] for e, p in zip(expected, prompts)]
    swaps = tight.engine.stats.num_swaps
    print(f"tiny model, {tight.policy.name}: {tight.num_preemptions} preemptions, {swaps} swaps")
    assert tight.num_preemptions > 0
    if tight.policy.name == "cacheopt":
        assert (swaps > 0) == (swap_space > 0) and (swaps < tight.num_preemptions) == (swap_space == 0)
    state = tight.engine.state
    assert state.blocks.num_free == 12 and len(state.table) == 0


def test_warmup_compiles_decode_and_mixed_steps_of_small_buckets(tiny_loaded: LoadedModel
                                                                      ) -> None:
    """With a decode kernel, a token bucket that can hold an all-decode step serves those and
    mixed ones (decodes plus a short chunk): warm-up compiles both, or the first mixed step
    compiles mid-serving. Beyond the sequence limit no step is all decodes."""
    llm = LLM(tiny_loaded, num_blocks=32, max_num_seqs=16, attention="pallas-interpret", warmup=False)
    llm.runner.warmup(shapes=[16, 32])
    assert set(llm.runner._executables) == {(16, False, None), (16, True, None), (32, False, None)}


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="compiled Pallas kernels need a GPU (CPU runs them interpreted above)")
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.xfail(
    reason="bf16 ids are not bit-identical: the kernels round softmax probabilities to bf16 "
           "before the PV product, the reference keeps them in float32; on an H100 "
           "(2026-11-22) tiny-llama's ids first differed after 4 to 40 tokens", strict=False))])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt", "smollm2-135m"])
def test_compiled_pallas_greedy_ids_equal_reference_on_gpu(model: str, dtype: str) -> None:
    """The Triton kernels end to end (ragged prefill, split-K decode, KV write, block
    gather/scatter): greedy ids equal the `reference` backend's on a roomy cache, and on a
    tight one that preempts by recompute and by swapping. (conftest makes XLA's float32
    matmuls exact on GPU, so the float32 comparison is between exact float32 paths.)"""
    loaded = load_model(model, dtype=jnp.dtype(dtype), seed=0)
    if model == "smollm2-135m":
        prompts, max_tokens = _chat_prompts(loaded), 32
    else:
        prompts = _random_prompts(loaded.config.vocab_size, [7, 12, 30, 9, 21, 15, 4, 33], seed=1)
        max_tokens = 40
    want = _engine_ids(LLM(loaded, num_blocks=256, attention="reference", warmup=False), prompts,
                       max_tokens)
    got = {"roomy": _engine_ids(LLM(loaded, num_blocks=256, attention="pallas", warmup=False),
                                prompts, max_tokens)}
    for policy in ("vllm", "vllm-swap"):
        tight = LLM(loaded, policy=policy, num_blocks=14, block_size=8, attention="pallas",
                    warmup=False)
        got[policy] = _engine_ids(tight, prompts, max_tokens)
        assert tight.num_preemptions > 0, policy
        assert tight.engine.state.blocks.num_free == 14
    for run, ids in got.items():
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(ids, want)]
        print(f"{model} {dtype} pallas ({run}): tokens equal to reference before the first "
              f"difference: {same} of {[len(w) for w in want]}")
    for run, ids in got.items():
        assert ids == want, run
