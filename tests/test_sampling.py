"""`sample_tokens`: greedy, temperature, top-k, top-p, per-request seeding and logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.runners.sampling import sample_tokens

_sample = jax.jit(sample_tokens)

def sample(logits, *, temperature=1.0, top_p=1.0, top_k=0, seeds=0, output_index=0):
    logits = np.asarray(logits, np.float32)
    n = logits.shape[0]

    def col(x, dtype):
        return np.broadcast_to(np.asarray(x).astype(dtype), (n,))

    tokens, logprobs = _sample(
        logits, col(temperature, np.float32), col(top_p, np.float32), col(top_k, np.int32),
        col(seeds, np.uint32), col(output_index, np.int32),
    )
    assert tokens.shape == (n,) and tokens.dtype == jnp.int32 and logprobs.shape == (n,)
    return np.asarray(tokens), np.asarray(logprobs)


def draws(logits_row, n, **kw):
    """`n` draws from one distribution: one row per output_index."""
    return sample(np.repeat(np.asarray(logits_row, np.float32)[None], n, 0),
                  output_index=np.arange(n), **kw)[0]


def _logits(rng, rows, vocab, scale=2.0):
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def test_greedy_rows_are_argmax_mixed_with_sampled_rows():
    rng = np.random.default_rng(0)
    logits = _logits(rng, 32, 50)
    temperature = np.where(np.arange(32) % 2 == 0, 0.0, 1.5).astype(np.float32)
    top_k = np.where(np.arange(32) % 4 == 1, 5, 0)
    top_p = np.where(np.arange(32) % 4 == 3, 0.9, 1.0)
    greedy = temperature == 0
    runs = [
        sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=np.arange(32),
               output_index=i)[0]
        for i in range(4)
    ]
    for tokens in runs:
        np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(-1))
        assert np.all((tokens >= 0) & (tokens < 50))
    # the sampled rows really sample
    assert any(np.any(t[~greedy] != runs[0][~greedy]) for t in runs[1:])


def test_all_greedy_batch_is_argmax():
    rng = np.random.default_rng(1)
    logits = _logits(rng, 32, 50)
    tokens, _ = sample(logits, temperature=0.0, top_k=3, top_p=0.5, seeds=np.arange(32))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_top_k_1_is_argmax():
    rng = np.random.default_rng(2)
    logits = _logits(rng, 32, 50, scale=0.5)
    temperature = np.resize([0.3, 1.0, 5.0], 32)
    for i in range(3):
        tokens, _ = sample(logits, temperature=temperature, top_k=1, seeds=np.arange(32),
                           output_index=i)
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_tiny_top_p_is_argmax():
    rng = np.random.default_rng(3)
    logits = _logits(rng, 32, 50, scale=0.5)
    temperature = np.resize([0.5, 1.0, 3.0], 32)
    tokens, _ = sample(logits, temperature=temperature, top_p=1e-6, seeds=np.arange(32))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_tokens_outside_top_k_are_never_drawn():
    rng = np.random.default_rng(4)
    vocab, rows, n = 16, 96, 48
    logits = _logits(rng, rows, vocab, scale=3.0)
    ks = np.resize([2, 3, 5, 8], rows)
    batch = np.repeat(logits, n, 0)  # row r's draws are rows r*n .. r*n+n-1
    tokens, _ = sample(batch, top_k=np.repeat(ks, n), seeds=7,
                       output_index=np.tile(np.arange(n), rows))
    order = np.argsort(-logits, axis=-1)
    bad = {}
    for r in range(rows):
        drawn = set(tokens[r * n : (r + 1) * n].tolist())
        outside = drawn - set(order[r, : ks[r]].tolist())
        if outside:
            bad[r] = (int(ks[r]), sorted(outside))
    assert not bad, f"row: (k, tokens drawn outside its top k): {bad}"


def test_top_k_sampling_sticks_to_top_k_on_a_benign_row():
    """Top-k filters on a row whose top-k softmax sums to >= 1.0 in float32."""
    logits = np.log(np.array([0.05, 0.3, 0.1, 0.4, 0.15, 0.0, 0.0, 0.0], np.float32) + 1e-9)
    top2 = jax.nn.softmax(jnp.asarray(logits[[3, 1]]))
    assert float(jnp.cumsum(top2)[-1]) >= 1.0  # the precondition of this test
    tokens = draws(logits, 3000, top_k=2, seeds=3)
    assert set(tokens.tolist()) == {1, 3}


PROBS = np.array([0.25, 0.015, 0.4, 0.05, 0.1, 0.005, 0.15, 0.03])  # sums to 1
# (top_p, top_k, support): cumulative sorted mass 0.4, 0.65, 0.8, 0.9, 0.95, 0.98, 0.995, 1
TOP_P_CASES = [
    (0.3, 0, {2}),
    (0.5, 0, {2, 0}),
    (0.85, 0, {2, 0, 6, 4}),
    (0.99, 0, {2, 0, 6, 4, 3, 7, 1}),
    (0.6, 4, {2, 0}),  # with or without renormalising over the top 4, 2 tokens reach 0.6
    (1.0, 0, set(range(8))),
]


def test_top_p_support_is_the_smallest_prefix_reaching_p():
    n = 3000
    logits = np.log(PROBS).astype(np.float32)
    m = len(TOP_P_CASES)
    tokens, _ = sample(
        np.tile(logits, (m * n, 1)),
        top_p=np.repeat([c[0] for c in TOP_P_CASES], n),
        top_k=np.repeat([c[1] for c in TOP_P_CASES], n),
        seeds=11,
        output_index=np.arange(m * n),
    )
    got = [set(tokens[i * n : (i + 1) * n].tolist()) for i in range(m)]
    assert got == [c[2] for c in TOP_P_CASES]


def test_same_seed_and_output_index_give_same_token_anywhere_in_the_batch():
    rng = np.random.default_rng(5)
    vocab, n = 50, 24
    logits = _logits(rng, n, vocab, scale=0.3)  # near-uniform: coincidences are unlikely
    seeds = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    out_idx = rng.integers(0, 1000, n)
    temp = rng.choice([0.7, 1.0, 1.3], n).astype(np.float32)
    together, _ = sample(logits, temperature=temp, seeds=seeds, output_index=out_idx)
    # row i moved to the end of a batch whose other rows are all greedy
    for i in range(3):
        filler = _logits(rng, 32, vocab)
        filler[-1] = logits[i]
        t = np.zeros(32, np.float32)
        t[-1] = temp[i]
        got = sample(filler, temperature=t, seeds=np.r_[np.zeros(31), seeds[i]],
                     output_index=np.r_[np.zeros(31), out_idx[i]])[0]
        assert got[-1] == together[i]

    # shuffled and mixed with other rows (greedy ones and other seeds), in a bigger batch
    others = _logits(rng, 8, vocab)
    perm = rng.permutation(n + 8)
    all_logits = np.concatenate([logits, others])[perm]
    all_temp = np.concatenate([temp, np.r_[np.zeros(4), np.ones(4)].astype(np.float32)])[perm]
    all_seeds = np.concatenate([seeds, np.arange(8, dtype=np.uint32)])[perm]
    all_idx = np.concatenate([out_idx, np.arange(8)])[perm]
    mixed, _ = sample(all_logits, temperature=all_temp, seeds=all_seeds, output_index=all_idx)
    back = np.empty_like(mixed)
    back[perm] = mixed
    np.testing.assert_array_equal(back[:n], together)
    # ... and the seed/index are what matter, not the row: another seed changes some tokens
    moved, _ = sample(logits, temperature=temp, seeds=seeds + 1, output_index=out_idx)
    assert np.any(moved != together)


def test_different_output_index_gives_varied_tokens():
    logits = np.zeros(50, np.float32)
    tokens = draws(logits, 32, seeds=99)
    assert len(set(tokens.tolist())) > 15  # 32 uniform draws over 50 tokens: ~24 distinct
    again = draws(logits, 32, seeds=99)
    np.testing.assert_array_equal(tokens, again)
    other_seed = draws(logits, 32, seeds=100)
    assert np.any(other_seed != tokens)


def test_logprobs_are_log_softmax_of_raw_logits():
    rng = np.random.default_rng(6)
    rows, vocab = 32, 50
    logits = _logits(rng, rows, vocab, scale=3.0)
    temperature = np.resize(np.array([0.0, 0.5, 1.0, 2.0], np.float32), rows)
    top_k = np.repeat([0, 3], rows // 2)
    top_p = np.resize(np.array([1.0, 1.0, 0.5, 0.9], np.float32), rows)
    tokens, logprobs = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                              seeds=np.arange(rows), output_index=5)
    x = logits.astype(np.float64)
    lsm = x - x.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, lsm[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)


def test_empirical_distribution_matches_softmax():
    logits = np.log(PROBS).astype(np.float32) * 0.7  # flatter than PROBS, all tokens visible
    n, temps = 4000, (1.0, 0.5)
    tokens, _ = sample(np.tile(logits, (2 * n, 1)), temperature=np.repeat(temps, n), seeds=2024,
                       output_index=np.arange(2 * n))
    for i, temperature in enumerate(temps):
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        counts = np.bincount(tokens[i * n : (i + 1) * n], minlength=len(p))
        expected = n * p
        chi2 = ((counts - expected) ** 2 / expected).sum()
        # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; a wrong temperature or bias gives hundreds
        assert chi2 < 30, (temperature, chi2, counts, expected.round())


def _exact(logits, temperature, top_k, top_p):
    """The distribution sampling must follow, in float64 from a full sort: softmax of the
    logits / temperature over the top-k tokens (ties kept), cut to the shortest prefix
    reaching top_p of that renormalised distribution."""
    z = logits.astype(np.float64) / temperature
    desc = np.sort(z)[::-1]
    kth = desc[top_k - 1] if top_k else -np.inf
    keep = z >= kth
    if top_p < 1:
        p = np.exp(desc - desc[0]) * (desc >= kth)
        cum = np.cumsum(p / p.sum())
        keep &= z >= desc[np.searchsorted(cum, top_p)]
    p = np.exp(z - z.max()) * keep
    return p / p.sum()


# (vocab, temperature, top_k, top_p): a vocabulary of several BLOCKs with a partial last
# one; cutoffs found among the candidates, and ones that need the full sort (top_k above
# CANDIDATES, a near-flat row whose nucleus is wider than the candidates)
CHI2_CASES = [
    (40, 0.7, 5, 1.0),
    (40, 1.3, 0, 0.8),
    (40, 1.0, 12, 0.9),
    (600, 1.0, 0, 1.0),
    (600, 0.5, 0, 0.7),
    (600, 1.0, 300, 1.0),
    (600, 4.0, 0, 0.95),
]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p", CHI2_CASES)
def test_draws_follow_the_exact_distribution(vocab, temperature, top_k, top_p):
    """Pearson's chi-square of 10,000 draws against the float64 distribution, tokens of
    small expected count pooled into one cell; P(fail) under the right distribution ~1e-4,
    while a wrong cutoff, temperature or block weighting gives thousands."""
    from scipy.stats import chi2

    rng = np.random.default_rng(vocab + top_k)
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    n = 10_000
    tokens = draws(logits, n, temperature=temperature, top_k=top_k, top_p=top_p, seeds=31)
    p = _exact(logits, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[p == 0].sum() == 0, "drew a token outside the top-k / nucleus"
    big = n * p >= 5
    observed = np.r_[counts[big], counts[~big].sum()]
    expected = np.r_[n * p[big], n * p[~big].sum()]
    if expected[-1] < 5:  # nothing worth a cell of its own: fold it into the smallest
        observed, expected = observed[:-1], expected[:-1]
        observed[-1] += counts[~big].sum()
        expected[-1] += n * p[~big].sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    assert stat < chi2.ppf(1 - 1e-4, len(observed) - 1), (stat, len(observed))


def _sorted_cutoffs(x, k, top_p):
    """The cutoffs as the sampler found them before issue 30, from the whole row sorted."""
    vocab = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)
    kth = jnp.where(k < vocab, jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)[:, 0], -jnp.inf)
    desc = jnp.where(desc < kth[:, None], -jnp.inf, desc)
    cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
    last = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), k - 1)
    nucleus = jnp.maximum(jnp.take_along_axis(desc, last[:, None], axis=-1)[:, 0], kth)
    return jnp.where(top_p < 1, nucleus, kth)


def test_cutoffs_equal_those_of_the_sorted_rows():
    """The cutoff found among the largest CANDIDATES logits, and by bisection, is the full
    sort's: a batch whose rows all have theirs among the candidates, one with a row whose
    nucleus is wider (it falls back to bisecting), top-k above CANDIDATES, and a batch with
    top-p alone; and a few rows at a time, as on a CPU."""
    from jserve.runners.sampling import CANDIDATES, _bisected_cutoffs, _cutoffs

    rng = np.random.default_rng(8)
    rows, vocab = 64, 2000
    x = jnp.asarray(_logits(rng, rows, vocab, scale=4.0))
    k = jnp.asarray(np.where(rng.random(rows) < 0.5, vocab, rng.integers(1, CANDIDATES + 1, rows)))
    top_p = jnp.asarray(rng.choice([1.0, 0.5, 0.8, 0.9], rows).astype(np.float32))
    cut = jnp.ones(rows, bool)
    sort, candidates, bisect = jax.jit(_sorted_cutoffs), jax.jit(_cutoffs), jax.jit(_bisected_cutoffs)
    want = np.asarray(sort(x, k, top_p))
    np.testing.assert_array_equal(np.asarray(candidates(x, k, top_p, cut)), want)
    np.testing.assert_array_equal(np.asarray(bisect(x, k, top_p)), want)
    # row 0 flat with top_p 0.99: its nucleus is ~1980 tokens, beyond the candidates
    flat = x.at[0].set(0.01 * x[0])
    top_p = top_p.at[0].set(0.99)
    k = k.at[0].set(vocab)
    np.testing.assert_array_equal(np.asarray(candidates(flat, k, top_p, cut)),
                                  np.asarray(sort(flat, k, top_p)))
    wide_k = jnp.asarray(rng.integers(CANDIDATES + 1, vocab, rows))
    np.testing.assert_array_equal(np.asarray(candidates(x, wide_k, top_p, cut)),
                                  np.asarray(sort(x, wide_k, top_p)))
    # a batch with top-p only bisects for the nucleus alone
    no_k = jnp.full(rows, vocab)
    np.testing.assert_array_equal(np.asarray(bisect(flat, no_k, top_p)),
                                  np.asarray(sort(flat, no_k, top_p)))
    # a few rows at a time (as on a CPU), padding the last pass: the same cutoffs, also where
    # passes whose rows the candidates settled skip their bisection (rows 0, 3, 6, ... not)
    mixed_k = jnp.where(jnp.arange(rows) % 3 == 0, wide_k, k)
    few_candidates = jax.jit(_cutoffs, static_argnums=4)
    for rows_per_pass in (2, 5):
        for logits, top_k in ((flat, k), (x, mixed_k)):
            np.testing.assert_array_equal(np.asarray(few_candidates(logits, top_k, top_p, cut, rows_per_pass)),
                                          np.asarray(sort(logits, top_k, top_p)))
    few = jax.jit(_bisected_cutoffs, static_argnums=3)
    for rows_per_pass in (2, 5):
        np.testing.assert_array_equal(np.asarray(few(x, k, top_p, rows_per_pass)),
                                      np.asarray(sort(x, k, top_p)))
        np.testing.assert_array_equal(np.asarray(few(flat, no_k, top_p, rows_per_pass)),
                                      np.asarray(sort(flat, no_k, top_p)))


def test_seeded_draws_repeat_exactly():
    """Same seeds and output indices, same tokens: with top-k and top-p rows, and when a
    row that needs the full sort joins the batch."""
    rng = np.random.default_rng(9)
    rows, vocab = 16, 700
    logits = _logits(rng, rows, vocab)
    kw = dict(temperature=np.resize([0.8, 1.0, 1.5], rows), top_k=np.resize([0, 20, 0, 100], rows),
              top_p=np.resize([1.0, 1.0, 0.9, 0.7], rows), seeds=np.arange(rows) * 7 + 1,
              output_index=np.arange(rows))
    first, _ = sample(logits, **kw)
    np.testing.assert_array_equal(sample(logits, **kw)[0], first)
    flat = np.concatenate([logits, 0.001 * logits[:1]])
    wide = {name: np.r_[v, v[0]] for name, v in kw.items()}
    wide["top_p"][-1] = 0.999
    np.testing.assert_array_equal(sample(flat, **wide)[0][:rows], first)
