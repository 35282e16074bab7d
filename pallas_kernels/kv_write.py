"""Scatter a step's new K/V (or hidden states) into a paged pool.

Pools are `[blocks, block_size, ...]`; token `t` goes to flat slot `slot_mapping[t]`.
Run inside a jit that donates the pages, so the pool is updated in place instead of being
copied every step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from jserve.pallas_kernels.row_copy import copy_rows, copy_rows_reference


def write_pages(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array,
                copy: Callable = copy_rows_reference) -> jax.Array:
    """`pages` with token `t` of `new: [T, ...]` written at slot `slot_mapping[t]`."""
    rows = pages.reshape(pages.shape[0] * pages.shape[1], -1)
    tokens = new.reshape(new.shape[0], -1)
    index = jnp.arange(new.shape[0], dtype=slot_mapping.dtype)
    if new.shape[0] == 1:
        # One token written twice: XLA makes a one-row scatter a dynamic-update-slice, and
        # the attention's read of that row then becomes a select over the pool's old value,
        # which keeps the old pool alive and copies it whole every layer.
        index, slot_mapping = jnp.zeros(2, index.dtype), jnp.tile(slot_mapping, 2)
    return copy(tokens, index, rows, slot_mapping).reshape(pages.shape)


def write_kv_reference(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write token `t`'s K/V at flat slot `slot_mapping[t]` of `[blocks, block_size, kv_heads, d]`."""
    return write_pages(k_pages, k, slot_mapping), write_pages(v_pages, v, slot_mapping)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
    *, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of `write_kv_reference`."""
    copy = partial(copy_rows, interpret=interpret)
    return (write_pages(k_pages, k, slot_mapping, copy),
            write_pages(v_pages, v, slot_mapping, copy))
