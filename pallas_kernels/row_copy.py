"""Copy rows between 2-D arrays by index: the one data-movement kernel behind the KV write
(step tokens -> their slots) and block gather/scatter (pool <-> a swap buffer).

`dst` is aliased to the result, so under a jit that donates it the copy happens in place
and the rest of the pool is never touched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jserve.pallas_kernels.attention_tiles import compiler_params, gather, next_pow2, scatter


def copy_rows_reference(src: jax.Array, src_rows: jax.Array, dst: jax.Array,
                        dst_rows: jax.Array) -> jax.Array:
    """`dst` with `dst[dst_rows[i]] = src[src_rows[i]]`; later `i` win on duplicate targets."""
    return dst.at[dst_rows].set(src[src_rows].astype(dst.dtype))


def copy_rows(src: jax.Array, src_rows: jax.Array, dst: jax.Array, dst_rows: jax.Array, *,
              block: int = 1024, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """Pallas version of `copy_rows_reference`: one program per (row, chunk of `block`
    columns). Duplicate targets get one of their sources (the KV write sends every padding
    token to the same scratch slot, whose content nobody reads)."""
    n = src_rows.shape[0]
    width = dst.shape[1]
    block = min(block, next_pow2(width))

    def kernel(src_ref, src_rows_ref, dst_rows_ref, _, dst_ref):
        i, c = pl.program_id(0), pl.program_id(1)
        cols = c * block + jnp.arange(block)
        valid = cols < width
        row = gather(src_ref, valid, src_rows_ref[i], cols)
        scatter(dst_ref, row.astype(dst_ref.dtype), valid, dst_rows_ref[i], cols)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(dst.shape, dst.dtype),
        grid=(n, pl.cdiv(width, block)),
        input_output_aliases={3: 0},
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="copy_rows",
    )(src, src_rows, dst_rows, dst)
