"""On-device token selection for a batch with per-request sampling settings, never sorting the
vocabulary unless it must: a two-level inverse-CDF draw, top-k / top-p cutoffs found among the
largest logits where they provably lie and by bisection over the row only where they do not,
and neither for a batch that does not need it. How, and what sorting cost: docs/serving.md,
Sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jserve.runners.penalties import Penalties, apply_penalties
from jserve.runners.token_rules import TokenRules, apply_rules

# Tokens per block of the two-level draw: the row's block masses and one block's token
# masses are the only cumulative sums taken (~sqrt of the vocabulary each).
BLOCK = 256
# The largest logits a top-k/top-p cutoff is looked for among before sorting the row.
CANDIDATES = 256


def sample_tokens(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S]; 0 = greedy
    top_p: jax.Array,  # [S]; 1 = off
    top_k: jax.Array,  # [S]; 0 = off
    seeds: jax.Array,  # [S] uint32
    output_index: jax.Array,  # [S] int32
    rows_per_pass: int | None = None,
    token_mask: jax.Array | None = None,  # [S, ceil(V / 32)] int32 bitmask
    masked: jax.Array | bool = False,  # bool scalar: apply `token_mask`
    penalties: Penalties | None = None,
    rules: TokenRules | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Next token and its log-probability (under the unmodified distribution) per row.

    Each row's randomness is `fold_in(key(seed), output_index)`, so a seeded request samples
    the same tokens whatever else shares its batches. `rows_per_pass` (static): how many
    rows a bisection takes its passes over at once, all where None (`_bisected_cutoffs`).
    With `masked`, a row draws only among the tokens its `token_mask` row allows (a
    grammar's, `apply_token_bitmask`); a step without it takes the other branch of a
    `lax.cond` and pays nothing for the mask. `penalties` change the logits tokens are
    chosen from (not the log-probabilities returned: vLLM's raw ones), computed only when
    some row has one. `rules` (logit biases, banned words, min_tokens) change them first, in
    vLLM's order, likewise only when some row has one.
    """
    raw = logits
    if rules is not None:
        logits = jax.lax.cond(rules.active, apply_rules, _unchanged, logits, rules)
    if penalties is not None:
        logits = jax.lax.cond(penalties.active, apply_penalties, _unchanged, logits, penalties)
    chosen = logits if token_mask is None else jax.lax.cond(
        masked, lambda: _grammar_first(logits, raw, token_mask), lambda: logits)
    greedy = jnp.argmax(chosen, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def stochastic() -> jax.Array:
        vocab = logits.shape[-1]
        x = chosen / jnp.where(sampled, temperature, 1.0)[:, None]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        cut = sampled & ((k < vocab) | (top_p < 1))
        cutoff = jax.lax.cond(jnp.any(cut), lambda: _cutoffs(x, k, top_p, cut, rows_per_pass),
                              lambda: jnp.full(x.shape[:1], -jnp.inf, x.dtype))
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)
        drawn = _draw(jnp.where(x >= cutoff[:, None], x, -jnp.inf), keys)
        return jnp.where(sampled, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(sampled), stochastic, lambda: greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), tokens[:, None], axis=-1)
    return tokens, logprobs[:, 0]


def _unchanged(logits: jax.Array, _: object) -> jax.Array:
    return logits


def _grammar_first(logits: jax.Array, raw: jax.Array, mask: jax.Array) -> jax.Array:
    """The grammar's tokens of `logits`; a row whose rules ban every token its grammar
    allows (min_tokens holding back EOS where the grammar allows only EOS, or a banned word
    that is the only way on) draws among its grammar's tokens of `raw`, without its rules
    and penalties: the output stays valid rather than taking a token outside the grammar."""
    allowed = _allowed_tokens(mask, logits.shape[-1])
    ruled = jnp.where(allowed, logits, -jnp.inf)
    stuck = jnp.all(ruled == -jnp.inf, axis=-1)
    return jnp.where(allowed, jnp.where(stuck[:, None], raw, logits), -jnp.inf)


def apply_token_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """`logits` with the tokens `mask` does not allow at -inf: bit `t % 32` of word
    `t // 32` of a row allows token t (llguidance's layout, sent packed: a 32nd of a bool
    mask's bytes from the host each step)."""
    return jnp.where(_allowed_tokens(mask, logits.shape[-1]), logits, -jnp.inf)


def _allowed_tokens(mask: jax.Array, vocab: int) -> jax.Array:
    """The bool `[rows, vocab]` a token bitmask packs (`apply_token_bitmask`'s layout)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=mask.dtype)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)


def _cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array, cut: jax.Array,
             rows_per_pass: int | None = None) -> jax.Array:
    """Per row, the smallest logit kept by its top-k (`k` tokens, ties kept) and top-p
    (the shortest prefix of the row sorted down whose mass, renormalised over the top-k
    tokens, reaches top_p; always >= 1 token): from the `CANDIDATES` largest logits where
    every row in `cut` provably has its cutoff among them, else by bisection."""
    vocab = x.shape[-1]
    c = min(CANDIDATES, vocab)
    # The barrier keeps XLA from folding the reads of `top` below into its sort-and-slice
    # form of top_k, which stops XLA:CPU from making it a partial sort (TopK custom call):
    # without it this function sorted the whole row (44 ms against 1.1 ms at batch 1).
    top = jax.lax.optimization_barrier(jax.lax.top_k(x, c)[0])  # [S, c], descending
    kth = jnp.where(k < vocab, jnp.take_along_axis(top, (jnp.minimum(k, c) - 1)[:, None], -1)[:, 0],
                    -jnp.inf)
    m = top[:, :1]
    mass = jnp.sum(jnp.where(x >= kth[:, None], jnp.exp(x - m), 0.0), axis=-1, keepdims=True)
    cum = jnp.cumsum(jnp.where(top >= kth[:, None], jnp.exp(top - m), 0.0), axis=-1) / mass
    cutoff = _cutoff(top, cum, k, kth, top_p)
    found = ((k <= c) | (k == vocab)) & ((top_p >= 1) | (cum[:, -1] >= top_p))
    known = found | ~cut
    return jax.lax.cond(jnp.all(known), lambda: cutoff,
                        lambda: _bisected_cutoffs(x, k, top_p, rows_per_pass, (cutoff, known)))


def _bisected_cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array, rows_per_pass: int | None = None,
                      known: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`_cutoffs` for any top_k and top_p without sorting, by `_bisect_rows`: over the
    whole batch at once where `rows_per_pass` is None, else over that many rows at a time
    (`lax.map`), each row's cutoff the same either way. A bisection takes 32 or 64 passes
    over its rows; on a CPU they are memory-bound unless the rows stay in its cache between
    passes: the nucleus bisection alone, on 64 rows of 49,152 logits, took 43-49 ms 2 rows
    at a time against 79-104 ms over the whole batch (`results/issue30_cpu.md`; the step
    with it: bench/sampling.py). On a GPU a pass over the whole batch is one kernel, and a
    map would run the rows' passes one after another.

    `known` (cutoffs, mask): rows whose cutoff the candidates already gave. A few rows at a
    time, a pass whose rows are all known takes theirs and skips its bisection: over real
    text one row in five of SmolLM2's has a 0.9 nucleus wider than the candidates, so a
    batch of 64 almost always bisects, but most pairs of rows need not."""
    rows = x.shape[0]
    if rows_per_pass is None or rows_per_pass >= rows:
        return _bisect_rows(x, k, top_p)
    n = -(-rows // rows_per_pass)
    pad = n * rows_per_pass - rows  # padding rows: all-zero logits, no top-k, no top-p, known

    def chunks(a: jax.Array, fill: float | bool) -> jax.Array:
        a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)
        return a.reshape(n, rows_per_pass, *a.shape[1:])

    cutoffs, mask = known if known is not None else (jnp.zeros(rows, x.dtype), jnp.zeros(rows, bool))

    def one(a: tuple[jax.Array, ...]) -> jax.Array:
        xs, ks, ps, cs, ms = a
        return jax.lax.cond(jnp.all(ms), lambda: cs, lambda: _bisect_rows(xs, ks, ps))

    out = jax.lax.map(one, (chunks(x, 0.0), chunks(k, x.shape[-1]), chunks(top_p, 1.0),
                            chunks(cutoffs, 0.0), chunks(mask, True)))
    return out.reshape(-1)[:rows]


def _bisect_rows(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The cutoffs of `x`'s rows: the k-th largest logit is the largest t with at least k
    logits >= t, the nucleus's last the largest t whose tokens >= t (within the top-k) hold
    top_p of the mass; each found by bisecting over the 32-bit keys of float32 values
    (`_largest`), one pass over the rows per bisection step. A full sort of SmolLM2's
    49,152 logits cost 38 ms a row on this CPU."""
    lo, hi = _key(jnp.min(x, axis=-1)), _key(jnp.max(x, axis=-1)) + 1
    topk = k < x.shape[-1]
    # A batch with top-p only (the common fallback: a nucleus wider than the candidates)
    # skips the k-th bisection, half the passes.
    kth = jax.lax.cond(
        jnp.any(topk),
        lambda: jnp.where(topk, _largest(lambda t: jnp.sum(x >= t[:, None], axis=-1) >= k, lo, hi),
                          -jnp.inf),
        lambda: jnp.full(x.shape[:1], -jnp.inf, x.dtype))
    p = jnp.where(x >= kth[:, None], jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), 0.0)
    target = top_p * jnp.sum(p, axis=-1)
    nucleus = _largest(lambda t: jnp.sum(jnp.where(x >= t[:, None], p, 0.0), axis=-1) >= target,
                       lo, hi)
    return jnp.where(top_p < 1, jnp.maximum(nucleus, kth), kth)


def _key(v: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jnp.where(bits >> 31 == 0, bits | jnp.uint32(0x80000000), ~bits)


def _value(key: jax.Array) -> jax.Array:
    """The inverse of `_key`."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest(holds: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest value t in [value(lo), value(hi)) for which `holds(t)`, where
    `holds` is true at `lo`, false at `hi` and monotone between: 32 halvings of the keys."""
    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(_value(mid)) & (hi - lo > 1)
        return jnp.where(ok, mid, lo), jnp.where(ok | (hi - lo <= 1), hi, mid)

    return _value(jax.lax.fori_loop(0, 32, halve, (lo, hi))[0])


def _cutoff(desc: jax.Array, cum: jax.Array, k: jax.Array, kth: jax.Array,
            top_p: jax.Array) -> jax.Array:
    """The cutoff from a row's largest logits sorted down (`desc`, at least up to the
    nucleus) and their cumulative probabilities: the nucleus's last logit, or the k-th
    where top-p is off; clamping the nucleus to the top-k keeps float rounding of `cum`
    from spilling past it."""
    last = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), jnp.minimum(k, desc.shape[-1]) - 1)
    nucleus = jnp.maximum(jnp.take_along_axis(desc, last[:, None], axis=-1)[:, 0], kth)
    return jnp.where(top_p < 1, nucleus, kth)


def _draw(x: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row with probability softmax(x) (-inf: never), by inverse CDF over
    blocks of `BLOCK` tokens, then within the block drawn; two uniforms per row."""
    rows, vocab = x.shape
    blocks = -(-vocab // BLOCK)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, blocks * BLOCK - vocab))).reshape(rows, blocks, BLOCK)
    u = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)
    block = _pick(jnp.sum(p, axis=-1), u[:, 0])
    within = jnp.take_along_axis(p, block[:, None, None], axis=1)[:, 0]
    return (block * BLOCK + _pick(within, u[:, 1])).astype(jnp.int32)


def _pick(w: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, index i with probability w[i] / sum(w), given a uniform u in [0, 1): the
    first whose cumulative weight exceeds u * sum(w). Clamped to the last positive weight,
    where rounding makes u * sum(w) reach the sum."""
    cum = jnp.cumsum(w, axis=-1)
    i = jnp.sum(cum <= (u * cum[:, -1])[:, None], axis=-1)
    last = w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, axis=-1)
    return jnp.minimum(i, last)
