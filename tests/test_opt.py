"""The OPT family on the paged interface computes what a dense, cache-free OPT computes, and
the big OPT shapes build with the published parameter counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jserve import LLM, SamplingParams
from jserve.engine.batch import Batch, BatchDelta, BatchInputs
from jserve.engine.view import SchedulerLimits
from jserve.runners.input_batch import PersistentBatch
from jserve.runners.jax_runner import Buckets, build_step_inputs
from jserve.models.dense_reference import dense_greedy_generate, dense_logits
from jserve.models.loading import LoadedModel, abstract_model, load_model
from jserve.models.opt import OPTForCausalLM, opt_weights_of
from jserve.models.paged import KVCache
from jserve.models.registry import get_config
from jserve.pallas_kernels.backends import select_attention

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tiny_opt() -> OPTForCausalLM:
    """Tiny OPT whose biases and LayerNorms are random too: fresh ones are 0 and 1, which
    would let an oracle or model that drops them pass."""
    model = OPTForCausalLM(get_config("tiny-opt"), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [p + 0.1 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, noisy))
    return model


def _paged_logits(
    model: OPTForCausalLM, cache: KVCache, tables: list[np.ndarray], start: list[int],
    new_tokens: list[list[int]],
) -> tuple[list[np.ndarray], KVCache]:
    """Run one ragged step the way `JaxRunner` builds it; the logits of every new token."""
    query_lens = np.array([len(t) for t in new_tokens], np.int32)
    n = len(new_tokens)
    inputs = BatchInputs(token_ids=np.concatenate(new_tokens).astype(np.int32),
                         output_index=np.zeros(n, np.int32),
                         delta=BatchDelta.of_sequences(range(n), tables))
    batch = Batch(seq_ids=np.arange(n), start=np.array(start, np.int32), query_lens=query_lens,
                  sample=np.ones(n, bool), inputs=inputs)
    buckets = Buckets.for_limits(SchedulerLimits(8, 128, MAX_MODEL_LEN), BLOCK_SIZE)
    # The runner's jit turns the numpy inputs into device arrays; do so here without a jit.
    held = PersistentBatch.holding(inputs.delta, buckets.max_blocks_per_seq, cache.scratch_block)
    x = build_step_inputs(batch, buckets, BLOCK_SIZE, held)
    x = jax.tree.map(jnp.asarray, x)
    hidden, cache = model(x.batch.token_ids, cache, x.batch.meta, select_attention("reference"))
    logits = np.asarray(model.logits(hidden))
    bounds = np.cumsum(query_lens)[:-1]
    return np.split(logits[: int(query_lens.sum())], bounds), cache


def test_paged_logits_match_dense_oracle(tiny_opt: OPTForCausalLM) -> None:
    """A prefill of several prompts (not block-aligned), then decode steps that read the
    cached prefix from the pages."""
    cfg = tiny_opt.cfg
    weights = opt_weights_of(tiny_opt)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (5, 16, 9)]
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    tables = [np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq, dtype=np.int32)
              for i in range(len(sequences))]
    cache = KVCache.zeros(cfg, len(sequences) * blocks_per_seq, BLOCK_SIZE, np.float32)

    start = [0] * len(sequences)
    new_tokens = sequences
    for _ in range(4):
        got, cache = _paged_logits(tiny_opt, cache, tables, start, new_tokens)
        for seq, s, logits in zip(sequences, start, got):
            want = dense_logits(cfg, weights, np.asarray(seq))[s:]
            np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
        start = [len(seq) for seq in sequences]
        new_tokens = [[int(rng.integers(3, cfg.vocab_size))] for _ in sequences]
        sequences = [seq + new for seq, new in zip(sequences, new_tokens)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("attention", ["reference", "pallas-interpret"])
def test_engine_greedy_matches_dense_oracle_with_and_without_preemption(attention: str) -> None:
    roomy = LLM("tiny-opt", weights="dummy", num_blocks=256, warmup=False)
    loaded: LoadedModel = roomy.model
    cfg = loaded.config
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (7, 12, 30, 9, 21, 4)]
    weights = opt_weights_of(loaded.model)
    expected = [dense_greedy_generate(cfg, weights, p, 24, cfg.eos_token_id) for p in prompts]
    assert _greedy(roomy, prompts, 24) == expected
    assert roomy.num_preemptions == 0

    # 12 blocks of 4 tokens: two or three sequences at a time, growth forces preemptions.
    tight = LLM(loaded, num_blocks=12, block_size=4, max_model_len=48, attention=attention,
                warmup=False)
    assert _greedy(tight, prompts, 24) == [e[: 48 - len(p)] for e, p in zip(expected, prompts)]
    assert tight.num_preemptions > 0
    assert tight.engine.state.blocks.num_free == 12


def test_opt_13b_builds_abstractly_with_the_published_parameter_count() -> None:
    cfg = get_config("opt-13b")
    model = abstract_model(cfg)
    assert isinstance(model, OPTForCausalLM)
    assert model.positions.embedding.get_value().shape == (cfg.max_position + 2, cfg.hidden_size)
    assert model.layers.fc1.kernel.get_value().shape == (cfg.num_layers, 5120, 20480)
    count = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == cfg.num_params
    assert cfg.num_params == pytest.approx(12.85e9, rel=0.01)


def test_opt_has_no_real_weights() -> None:
    with pytest.raises(ValueError, match="no real weights are available for 'opt-13b'"):
        load_model("opt-13b", weights="real")
