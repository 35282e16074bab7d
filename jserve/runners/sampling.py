"""On-device token selection for a batch with per-request sampling settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S]; 0 = greedy
    top_p: jax.Array,  # [S]; 1 = off
    top_k: jax.Array,  # [S]; 0 = off
    seeds: jax.Array,  # [S] uint32
    output_index: jax.Array,  # [S] int32
) -> tuple[jax.Array, jax.Array]:
    """Next token and its log-probability (under the unmodified distribution) per row.

    Each row's randomness is `fold_in(key(seed), output_index)`, so a seeded request samples
    the same tokens whatever else shares its batches. The sort that top-p/top-k need is
    skipped entirely (`lax.cond`) when the whole batch is greedy.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic() -> jax.Array:
        vocab = logits.shape[-1]
        x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        desc = -jnp.sort(-x, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        desc = jnp.where(desc < kth, -jnp.inf, desc)
        cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
        # The nucleus is the shortest prefix whose mass reaches top_p (always >= 1 token);
        # clamping to the top-k keeps float rounding of `cum` from spilling past it.
        last = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), k - 1)
        cutoff = jnp.maximum(jnp.take_along_axis(desc, last[:, None], axis=-1), kth)
        x = jnp.where(x < cutoff, -jnp.inf, x)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)
    return tokens, logprobs[:, 0]
