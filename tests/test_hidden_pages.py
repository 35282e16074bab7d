"""Hidden rows in a KV block's K page then V page (Apt-Serve's unified pool): the jnp
reference over that layout equals the reference over a dedicated hidden pool holding the
same rows, and the Pallas kernel (interpreted on CPU) equals the reference; and the pool's
sizes per model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import interpret, mixed_case

from jserve.cache.sizing import hidden_block_tokens
from jserve.models.registry import get_config
from jserve.pallas_kernels.hidden_attention import (
    HiddenPool, KVProjection, hidden_paged_attention, hidden_paged_attention_reference,
)


def _unified(dedicated: np.ndarray, block_size: int, kv_heads: int, head_dim: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """K and V pages `[blocks, block_size, kv_heads, head_dim]` (random where unused) whose
    K pages start with the first half of each dedicated block's rows, V pages the rest."""
    blocks, width, hidden = dedicated.shape
    rows = width // 2
    rng = np.random.default_rng(1)
    pages = [rng.standard_normal((blocks, block_size * kv_heads * head_dim)).astype(np.float32) for _ in range(2)]
    for page, half in zip(pages, (dedicated[:, :rows], dedicated[:, rows:])):
        page[:, : rows * hidden] = half.reshape(blocks, -1)
    return tuple(p.reshape(blocks, block_size, kv_heads, head_dim) for p in pages)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, hidden, theta", [
    (4, 4, 16, 4, 64, 10000.0),  # MHA: 4 rows a page, no room left over, RoPE
    (6, 3, 32, 4, 160, None),  # GQA: 2 rows of 160 in a page of 384 values, OPT-style
])
def test_rows_in_kv_pages_attend_like_a_dedicated_pool(heads, kv_heads, head_dim, block_size, hidden, theta):
    rows = block_size * kv_heads * head_dim // hidden
    width = 2 * rows  # tokens a hidden block holds
    rng = np.random.default_rng(hidden)
    case = mixed_case(rng, heads, kv_heads, head_dim, width)
    meta = jax.tree.map(jnp.asarray, case.meta)
    dedicated = rng.standard_normal((case.k_pages.shape[0], width, hidden)).astype(np.float32)
    k_pages, v_pages = _unified(dedicated, block_size, kv_heads, head_dim)
    pool = HiddenPool.in_kv_pages(jnp.asarray(k_pages), jnp.asarray(v_pages), hidden)
    assert (pool.rows_per_page, pool.block_tokens) == (rows, width)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    bias = theta is None
    proj = KVProjection(w(hidden, kv_heads * head_dim), w(hidden, kv_heads * head_dim),
                        w(kv_heads * head_dim) if bias else None, w(kv_heads * head_dim) if bias else None, theta)
    q, scale = jnp.asarray(case.q), head_dim**-0.5
    want = hidden_paged_attention_reference(q, jnp.asarray(dedicated), proj, meta, scale=scale)
    got = hidden_paged_attention_reference(q, pool, proj, meta, scale=scale)
    kernel = hidden_paged_attention(q, pool, proj, meta, scale=scale, block_m=16, block_k=16, block_d=32,
                                    interpret=interpret())
    t = case.t_real
    np.testing.assert_allclose(np.asarray(got)[:t], np.asarray(want)[:t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kernel)[:t], np.asarray(want)[:t], rtol=2e-5, atol=2e-5)


def test_hidden_block_tokens_per_model() -> None:
    """Twice the block for MHA (the cache halves); fewer than a block for GQA (SmolLM2: 10 of
    16); 0 where a page cannot hold one row."""
    assert hidden_block_tokens(get_config("opt-13b"), 16) == 32
    assert hidden_block_tokens(get_config("tiny-llama-mha"), 16) == 32
    assert hidden_block_tokens(get_config("smollm2-135m"), 16) == 10
    assert hidden_block_tokens(get_config("llama-2-70b"), 16) == 4
    assert hidden_block_tokens(get_config("tiny-llama"), 1) == 0
