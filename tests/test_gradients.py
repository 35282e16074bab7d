"""Gradients through the functional API: the `dense` attention backend computes what the
reference does, and `jax.grad` through it matches finite differences, including through a
cached prefix written by an earlier step of the same differentiated function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GEOMETRIES, assert_close, mixed_case, oracle

from jserve.models import functional
from jserve.models.dense_reference import dense_logits
from jserve.models.llama import llama_weights_of
from jserve.models.registry import get_config
from jserve.pallas_kernels.backends import select_attention

CFG = get_config("tiny-llama")
BLOCK, MAX_LEN = 16, 64
LONG = [5, 17, 42, 8, 99, 3, 250, 7, 7, 300, 11, 64, 128, 2, 9, 33, 71, 5, 1, 400]  # crosses a block
SHORT = [7, 7, 300, 12, 13]
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7]]
SPLIT = 13  # the chunked schedule computes LONG[:SPLIT] first, the rest from the cache


def _batch(cache: functional.KVCache, tokens: list[list[int]], start: list[int]) -> functional.PagedBatch:
    return functional.make_batch(cache, tokens, start, TABLES[: len(tokens)], max_len=MAX_LEN,
                                 vocab_size=CFG.vocab_size)


def _empty_cache() -> functional.KVCache:
    return functional.KVCache.zeros(CFG, num_blocks=8, block_size=BLOCK, dtype=jnp.float32)


def _all_logits(model: functional.PagedModel, params, chunked: bool) -> tuple[jax.Array, jax.Array]:
    """Logits at every position of LONG and SHORT, computed in one step, or (`chunked`) in
    two: LONG's first SPLIT tokens beside SHORT, then the rest of LONG over its cached prefix."""
    cache = _empty_cache()
    if not chunked:
        hidden, _ = model.hidden_states(params, cache, _batch(cache, [LONG, SHORT], [0, 0]))
        return model.logits(params, hidden[: len(LONG)]), model.logits(params, hidden[len(LONG) : len(LONG) + len(SHORT)])
    hidden, cache = model.hidden_states(params, cache, _batch(cache, [LONG[:SPLIT], SHORT], [0, 0]))
    first, short = hidden[:SPLIT], hidden[SPLIT : SPLIT + len(SHORT)]
    rest, _ = model.hidden_states(params, cache, _batch(cache, [LONG[SPLIT:]], [SPLIT]))
    long = jnp.concatenate([first, rest[: len(LONG) - SPLIT]])
    return model.logits(params, long), model.logits(params, short)


def _loss(model: functional.PagedModel, chunked: bool):
    """Mean next-token cross-entropy over both sequences."""
    def loss(params) -> jax.Array:
        terms = []
        for logits, seq in zip(_all_logits(model, params, chunked), (LONG, SHORT), strict=True):
            logp = jax.nn.log_softmax(logits[:-1])
            terms.append(-jnp.take_along_axis(logp, jnp.asarray(seq[1:])[:, None], axis=1)[:, 0])
        return jnp.concatenate(terms).mean()
    return loss


@pytest.fixture(scope="module")
def tiny() -> tuple[functional.PagedModel, object]:
    return functional.init(CFG, seed=0, attention="dense")


@pytest.fixture(scope="module")
def loss_and_grad(tiny):
    """The jitted value-and-gradient of the loss in each schedule, compiled once per module."""
    model, _ = tiny
    return {chunked: jax.jit(jax.value_and_grad(_loss(model, chunked))) for chunked in (False, True)}


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_dense_attention_matches_the_oracle(geometry: tuple[int, int, int, int]) -> None:
    """The kernel tests' ragged steps (decodes, prompts, chunks mid-page, padding), against
    the float64 oracle the reference is held to."""
    case = mixed_case(np.random.default_rng(1), *geometry)
    args = [jnp.asarray(x) for x in (case.q, case.k_new, case.v_new, case.k_pages, case.v_pages)]
    out, _, _ = select_attention("dense")(*args, jax.tree.map(jnp.asarray, case.meta),
                                          scale=case.q.shape[-1] ** -0.5)
    assert_close(np.asarray(out), oracle(case), case.t_real, rtol=1e-5, atol=1e-5)


def test_dense_model_matches_reference_backend_and_dense_oracle(tiny) -> None:
    """Logits at every position, two sequences in two steps (one over a cached prefix)."""
    model, params = tiny
    dense = jax.jit(lambda p: _all_logits(model, p, chunked=True))(params)
    ref_model = model.with_attention("reference")
    ref = jax.jit(lambda p: _all_logits(ref_model, p, chunked=True))(params)
    weights = llama_weights_of(model.bind(params))
    for got, want, seq in zip(dense, ref, (LONG, SHORT), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, dense_logits(CFG, weights, np.asarray(seq)), rtol=1e-4, atol=1e-4)


def test_gradient_matches_finite_differences(tiny, loss_and_grad) -> None:
    """Along a random unit direction in each parameter array in turn, the gradient's
    directional derivative against a central difference, through the chunked schedule (so
    through the cache a first step wrote and a second step read)."""
    _, params = tiny
    step = loss_and_grad[True]
    _, grads = step(params)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    eps = 0.03
    for i, (leaf, grad) in enumerate(zip(leaves, jax.tree.leaves(grads), strict=True)):
        u = rng.standard_normal(leaf.shape).astype(np.float32)
        u /= np.linalg.norm(u)
        moved = [jax.tree.unflatten(treedef, [*leaves[:i], leaf + s * eps * u, *leaves[i + 1 :]])
                 for s in (1, -1)]
        finite = float(step(moved[0])[0] - step(moved[1])[0]) / (2 * eps)
        analytic = float(jnp.vdot(grad, u))
        assert abs(analytic - finite) <= 1e-2 * abs(analytic) + 1e-4, (i, analytic, finite)


def test_chunked_and_whole_prompt_gradients_agree(tiny, loss_and_grad) -> None:
    """The loss computed in one step or in two over a cached prefix: same value and gradient."""
    _, params = tiny
    (whole, whole_grads), (chunked, chunked_grads) = (loss_and_grad[c](params) for c in (False, True))
    np.testing.assert_allclose(whole, chunked, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(whole_grads), jax.tree.leaves(chunked_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
