"""Rotate-half rotary position embedding (Llama's), shared by the models and the kernels'
references so both rotate exactly alike."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's `rope_scaling` (`rope_type: llama3`): long-wavelength frequencies slowed by
    `factor`, short ones kept, those between interpolated, so a model trained on
    `original_max_position` tokens reads longer contexts. Hashable: a static argument."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def scale(self, inv_freq: jax.Array) -> jax.Array:
        wavelength = 2 * math.pi / inv_freq
        slowed = inv_freq / self.factor
        # 0 at the long-wavelength edge (wavelength = original / low_freq_factor), 1 at the short.
        smooth = ((self.original_max_position / wavelength - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        between = (1 - smooth) * slowed + smooth * inv_freq
        long = wavelength > self.original_max_position / self.low_freq_factor
        short = wavelength < self.original_max_position / self.high_freq_factor
        return jnp.where(long, slowed, jnp.where(short, inv_freq, between))


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
                        ) -> jax.Array:
    """`[head_dim]`: the frequency of each column, the two halves alike (rotate-half pairs
    column `i` with column `i + head_dim/2`)."""
    half = jnp.arange(head_dim) % (head_dim // 2)
    inv_freq = theta ** (-2.0 * half.astype(jnp.float32) / head_dim)
    return inv_freq if scaling is None else scaling.scale(inv_freq)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: Llama3RopeScaling | None = None) -> jax.Array:
    """Rotate `x: [T, heads, head_dim]` by its tokens' integer `positions`."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(jnp.float32) * inverse_frequencies(x.shape[-1], theta, scaling)
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
