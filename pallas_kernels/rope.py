"""Rotate-half rotary position embedding (Llama's), shared by the models and the kernels'
references so both rotate exactly alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inverse_frequencies(head_dim: int, theta: float) -> jax.Array:
    """`[head_dim]`: the frequency of each column, the two halves alike (rotate-half pairs
    column `i` with column `i + head_dim/2`)."""
    half = jnp.arange(head_dim) % (head_dim // 2)
    return theta ** (-2.0 * half.astype(jnp.float32) / head_dim)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate `x: [T, heads, head_dim]` by its tokens' integer `positions`."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(jnp.float32) * inverse_frequencies(x.shape[-1], theta)
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
